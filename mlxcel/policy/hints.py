"""The persisted hint: a settled verdict on disk, so a restart does not re-profile.

The files are private (the endpoint is the interface): their layout and
:data:`HINT_VERSION` may change in any release. Every failure here degrades to
"no hint" or "kept in memory" with one warning; none of them stops the server.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .estimator import DECLINE, ENABLE, Verdict

logger = logging.getLogger(__name__)

#: On-disk format and verdict semantics. Bump it whenever stored verdicts must
#: be discarded and re-profiled. Unrelated to the wire ``schema_version``.
#: 2: rounds pipelined and the enable line moved from 1.5 to 1.1.
#: 3: the kernels' versions (``kernels``) stored beside the verdict.
#: 4: ``depth_limit``, the context length from which an enable verdict's samples estimate the burst loses.
HINT_VERSION = 4

#: Subdirectory of the cache root that holds the hints.
HINT_DIR = "mtp-policy"

# A hint is a few hundred bytes; anything much larger is not one of ours, and
# is not worth reading into memory to find that out.
_MAX_HINT_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class _Beside:
    """A file kept beside a pairing's hint: its format's version, its payload's field, its size bound."""

    version: int
    field: str
    limit: int
    what: str


#: The continuous batch's step costs beside the hint (``<digest>.batch.json``): its own format and version.
BATCH_VERSION = 1
_BATCH = _Beside(BATCH_VERSION, "table", 1024 * 1024, "the batch's step costs")
#: The exactness probes' outcomes, in a folder beside the hints (``exactness/<digest>.json``): what this
#: machine's kernels gave the served files, so that a restart does not probe again.
PROBE_VERSION = 1
PROBE_DIR = "exactness"
_PROBE = _Beside(PROBE_VERSION, "record", 256 * 1024, "the exactness probes' outcomes")

_FIELDS = ("version", "target", "drafter", "hardware", "block_size",
           "verdict", "acceptance_rate", "samples", "estimated_speedup", "kernels", "depth_limit")


@dataclass(frozen=True, slots=True)
class PairingKey:
    """What a verdict is about: (target, drafter, hardware, block size)."""

    target: str
    drafter: str
    hardware: str
    block_size: int

    def digest(self) -> str:
        """First 16 hex digits of SHA-256 of ``target|drafter|hardware|K<block_size>``."""
        text = f"{self.target}|{self.drafter}|{self.hardware}|K{self.block_size}"
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Hint:
    """A settled verdict as stored. ``acceptance_rate`` has two decimals."""

    key: PairingKey
    verdict: Verdict
    acceptance_rate: float
    samples: int
    estimated_speedup: float | None
    depth_limit: int | None = None
    """Context tokens from which an enable verdict's samples estimate the burst loses (the rule of K's prior
    at width 1); None: it pays at every depth."""

    def to_json(self, kernels: Mapping[str, str]) -> dict[str, Any]:
        return {
            "version": HINT_VERSION,
            "target": self.key.target,
            "drafter": self.key.drafter,
            "hardware": self.key.hardware,
            "block_size": self.key.block_size,
            "verdict": self.verdict,
            "acceptance_rate": self.acceptance_rate,
            "samples": self.samples,
            "estimated_speedup": self.estimated_speedup,
            "kernels": dict(kernels),
            "depth_limit": self.depth_limit,
        }


class HintStore:
    """Hints under ``<cache root>/mtp-policy/<key digest>.json``.

    *kernels* names the libraries whose kernels the verdict measured, with
    their versions (``{"mlx": "0.32.4", "mlx-lm": "0.32.2"}``): a verify's cost
    moves between releases, so a hint stored under other versions is not
    restored and the pairing profiles again. The pairing key, which is the
    contract's, does not change with them.
    """

    def __init__(self, cache_root: Path, kernels: Mapping[str, str] | None = None) -> None:
        self.directory = Path(cache_root) / HINT_DIR
        self.kernels: dict[str, str] = dict(kernels or {})
        self._warned: set[str] = set()

    def path_for(self, key: PairingKey) -> Path:
        return self.directory / f"{key.digest()}.json"

    def load(self, key: PairingKey) -> Hint | None:
        """The stored hint for exactly *key*, or None (missing, unreadable, or foreign)."""
        path = self.path_for(key)
        try:
            raw = _read_regular(path, _MAX_HINT_BYTES + 1)
        except (FileNotFoundError, NotADirectoryError):
            return None  # nothing stored; a cache root that cannot hold files warns on save
        except OSError as exc:
            self._warn(path, f"cannot read it ({exc.strerror or exc})")
            return None
        if raw is None:
            self._warn(path, "it is not a regular file")
            return None
        if len(raw) > _MAX_HINT_BYTES:
            self._warn(path, "it is too large to be a hint")
            return None
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            self._warn(path, "it is not valid JSON (corrupt or truncated)")
            return None
        problem = _validate(body, key) or _other_kernels(body["kernels"], self.kernels)
        if problem:
            self._warn(path, problem)
            return None
        return Hint(key=key, verdict=body["verdict"], acceptance_rate=float(body["acceptance_rate"]),
                    samples=body["samples"], estimated_speedup=_opt_float(body["estimated_speedup"]),
                    depth_limit=body["depth_limit"])

    def save(self, hint: Hint) -> Path | None:
        """Write *hint* atomically; the path written, or None if the cache is unwritable.

        The body goes to a temporary file in the same directory, is flushed to
        disk, and is renamed over the final name, so a reader (or a second
        process settling the same pairing) sees an old whole file or a new whole
        file, never a torn one.
        """
        path = self.path_for(hint.key)
        data = (json.dumps(hint.to_json(self.kernels), indent=2) + "\n").encode("utf-8")
        return self._write(path, data, "the verdict stays in memory and this pairing re-profiles after a restart",
                           "not persisting the MTP verdict to")

    def batch_path_for(self, key: PairingKey) -> Path:
        return self.directory / f"{key.digest()}.batch.json"

    def load_batch(self, key: PairingKey) -> dict[str, Any] | None:
        """The continuous batch's measured step costs stored for *key* under these kernels, or None (missing,
        unreadable, foreign, measured under other kernels: a warning says which, once)."""
        return self._load_beside(self.batch_path_for(key), key, _BATCH, "ignoring the batch's step costs",
                                 "measuring them again")

    def save_batch(self, key: PairingKey, table: dict[str, Any]) -> Path | None:
        """Write the batch's measured step costs *table* for *key*, atomically as a hint."""
        return self._save_beside(self.batch_path_for(key), key, _BATCH, table, "the batch measures its step costs "
                                 "again after a restart", "not persisting the batch's step costs to")

    def probe_path_for(self, key: PairingKey) -> Path:
        return self.directory / PROBE_DIR / f"{key.digest()}.json"

    def load_probe(self, key: PairingKey) -> dict[str, Any] | None:
        """The exactness probes' outcomes stored for *key* under these kernels, or None (as :meth:`load_batch`).
        Whether they hold for this machine and these files (the record's ``fingerprint``) is the engine's
        to judge (:mod:`mlxcel.engine.probe_memo`)."""
        return self._load_beside(self.probe_path_for(key), key, _PROBE, "ignoring the exactness probes' outcomes",
                                 "probing again")

    def save_probe(self, key: PairingKey, record: dict[str, Any]) -> Path | None:
        """Write the exactness probes' outcomes *record* for *key*, atomically as a hint."""
        return self._save_beside(self.probe_path_for(key), key, _PROBE, record, "the server probes again after a "
                                 "restart", "not persisting the exactness probes' outcomes to")

    def _load_beside(self, path: Path, key: PairingKey, kind: _Beside, action: str,
                     consequence: str) -> dict[str, Any] | None:
        """The payload of a file kept beside *key*'s hint, or None (missing, unreadable, foreign, written
        under other kernels: warned once, with *action* and *consequence*)."""
        try:
            raw = _read_regular(path, kind.limit + 1)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            self._warn(path, f"cannot read it ({exc.strerror or exc})", action=action)
            return None
        problem, body = None, None
        if raw is None:
            problem = "it is not a regular file"
        elif len(raw) > kind.limit:
            problem = "it is too large"
        else:
            try:
                body = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError):
                problem = "it is not valid JSON (corrupt or truncated)"
        if problem is None:
            problem = _validate_beside(body, key, kind) or _other_kernels(
                body["kernels"], self.kernels, consequence)  # type: ignore[index]
        if problem:
            self._warn(path, problem, action=action)
            return None
        payload: dict[str, Any] = body[kind.field]  # type: ignore[index]
        return payload

    def _save_beside(self, path: Path, key: PairingKey, kind: _Beside, payload: dict[str, Any], consequence: str,
                     action: str) -> Path | None:
        body = {"version": kind.version, "target": key.target, "drafter": key.drafter, "hardware": key.hardware,
                "block_size": key.block_size, "kernels": dict(self.kernels), kind.field: payload}
        return self._write(path, (json.dumps(body, indent=1) + "\n").encode("utf-8"), consequence, action)

    def _write(self, path: Path, data: bytes, consequence: str, action: str) -> Path | None:
        """*data* to *path* atomically (a temporary file flushed to disk, renamed over it); the path, or None
        if the cache is unwritable (warned once)."""
        tmp: str | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
        except OSError as exc:
            self._warn(path, f"cannot write it ({exc.strerror or exc}); {consequence}", action=action)
            return None
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        return path

    def _warn(self, path: Path, problem: str, action: str = "ignoring the MTP policy hint") -> None:
        message = f"{action} {path}: {problem}"
        if message not in self._warned:
            self._warned.add(message)
            logger.warning("%s", message)


def _read_regular(path: Path, limit: int) -> bytes | None:
    """Up to *limit* bytes of *path*, or None if it is not a regular file.

    Opened non-blocking and checked before reading: a FIFO (or a device) at a
    hint's path would otherwise block the worker, and with it startup and
    SIGTERM, for ever. O_NONBLOCK changes nothing for a regular file.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit)
    finally:
        os.close(fd)


def _opt_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


def _validate(body: Any, key: PairingKey) -> str | None:
    """Why *body* is not a valid hint for *key*, or None if it is."""
    if not isinstance(body, dict):
        return "it is not a JSON object"
    if body.get("version") != HINT_VERSION:
        return f"its version is {body.get('version')!r}, this server writes {HINT_VERSION}"
    # Any unknown or missing field makes the file foreign. That is safe only
    # because HINT_VERSION gates every format change: a release that adds a
    # field must bump it (older servers then re-profile instead of reading a
    # hint they half understand), never add the field at the same version.
    if set(body) != set(_FIELDS):
        return "its fields are not those of a hint"
    stored = (body["target"], body["drafter"], body["hardware"], body["block_size"])
    if type(body["block_size"]) is not int or stored != (
            key.target, key.drafter, key.hardware, key.block_size):
        return "it belongs to another pairing"
    if body["verdict"] not in (ENABLE, DECLINE):
        return f"its verdict {body['verdict']!r} is not enable or decline"
    rate = body["acceptance_rate"]
    if not (_is_number(rate) and 0 <= rate <= 1):
        return "its acceptance_rate is not a number between 0 and 1"
    samples = body["samples"]
    if not (isinstance(samples, int) and not isinstance(samples, bool) and samples >= 1):
        return "its samples is not a positive integer"
    speedup = body["estimated_speedup"]
    if not (speedup is None or (_is_number(speedup) and speedup >= 0)):
        return "its estimated_speedup is not a non-negative number"
    limit = body["depth_limit"]
    if not (limit is None or (type(limit) is int and limit >= 1)):
        return "its depth_limit is not a positive integer or null"
    kernels = body["kernels"]
    if not (isinstance(kernels, dict) and len(kernels) <= 16
            and all(isinstance(k, str) and isinstance(v, str) for k, v in kernels.items())):
        return "its kernels is not an object of library versions"
    return None


def _validate_beside(body: Any, key: PairingKey, kind: _Beside) -> str | None:
    """Why *body* is not a file of *kind* for *key*, or None if it is (the payload's own checks are its
    reader's: the rule's :meth:`~.draft_length.DraftLength.restore`, the engine's probe memo)."""
    if not isinstance(body, dict):
        return "it is not a JSON object"
    if body.get("version") != kind.version:
        return f"its version is {body.get('version')!r}, this server writes {kind.version}"
    if set(body) != {"version", "target", "drafter", "hardware", "block_size", "kernels", kind.field}:
        return f"its fields are not those of {kind.what}"
    if (body["target"], body["drafter"], body["hardware"], body["block_size"]) != (
            key.target, key.drafter, key.hardware, key.block_size) or type(body["block_size"]) is not int:
        return "it belongs to another pairing"
    kernels = body["kernels"]
    if not (isinstance(kernels, dict) and len(kernels) <= 16
            and all(isinstance(k, str) and isinstance(v, str) for k, v in kernels.items())):
        return "its kernels is not an object of library versions"
    if not isinstance(body[kind.field], dict):
        return f"its {kind.field} is not an object"
    return None


def _other_kernels(stored: dict[str, str], running: dict[str, str],
                   consequence: str = "profiling the pairing again") -> str | None:
    """Why a hint measured under *stored* kernels is stale here, or None."""
    if stored == running:
        return None
    return f"it was measured under {_spell(stored)} and this server runs {_spell(running)}; {consequence}"


def _spell(kernels: dict[str, str]) -> str:
    return ", ".join(f"{name} {version}" for name, version in sorted(kernels.items())) or "unknown kernels"
