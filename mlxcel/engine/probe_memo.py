"""The exactness probes' outcomes, kept so that a restart does not probe again.

At boot the burst's probe (:func:`~.exactness.probe_exactness`) and the batch's
(:func:`~.exactness.probe_batch_widths`) check the served pairing's verify
against classic decode on this machine's kernels: seconds on a model of a GB,
a minute with 16 batch widths, before the server is ready. What they found
holds for as long as everything their bytes depend on is unchanged, so it is
stored beside the pairing's hint (:meth:`~mlxcel.policy.HintStore.save_probe`)
with a *fingerprint* of those things, and a later start whose fingerprint is
the same takes the stored outcome instead of probing.

The fingerprint errs on the side of probing again: the mlxcel, mlx and mlx-lm
builds (mlxcel's by its source files, which a development checkout edits
without a version bump), the BLAS and its threads, the CPU and the OS, the
device, the loaded BLAS and MLX libraries' files, the target's and the
drafter's files (names, sizes and modification times), the settings that reach
the probed forward (``--kv-bits``, ``--draft-quantize``, the context length).
A file that does not match is logged and replaced after the probe. The row
split :mod:`~mlxcel.models.row_exact` measured before the probes (which
products pad or chunk: its bytes depend on the same things) is kept with their
outcomes, and a start that takes them takes it too, instead of measuring it.

Worker thread only (the fingerprint reads mlx's device).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..models.row_exact import RowSplit
from ..models.speculative import DESCRIBE
from ..policy import HintStore, PairingKey
from .exactness import ProbeResult

logger = logging.getLogger(__name__)

#: Files of the loaded shared libraries whose kernels the probes ran (Linux: ``/proc/self/maps``).
_KERNEL_FILES = ("blas", "mkl", "lapack", "libmlx", "libcuda", "libcudnn")
#: Environment variables that choose kernels with the same library files (a core type, MKL's conditional
#: numerical reproducibility, thread counts, which GPU).
_KERNEL_ENVIRONMENT = ("MLX_", "OPENBLAS", "GOTO", "MKL_", "OMP_", "CUBLAS", "CUDA_", "METAL_")


#: How the log says an outcome was kept, not probed.
KEPT = "found at an earlier start on this machine, with these files and kernels"


class ProbeMemo:
    """One pairing's stored probe outcomes, valid for *fingerprint*; empty where none was stored for it."""

    def __init__(self, hints: HintStore, key: PairingKey, fingerprint: dict[str, str]) -> None:
        self._hints, self._key, self._fingerprint = hints, key, fingerprint
        self._burst: ProbeResult | None = None
        self._batch: dict[str, Any] | None = None
        self._split: dict[str, Any] | None = None
        record = hints.load_probe(key)
        if record is None:
            return
        path = hints.probe_path_for(key)
        if record.get("fingerprint") != fingerprint:
            stored = record.get("fingerprint")
            changed = sorted(k for k in fingerprint if not isinstance(stored, dict) or stored.get(k) != fingerprint[k])
            logger.info("probing again: the exactness probes' outcomes in %s were found with another %s", path,
                        ", ".join(changed) or "fingerprint")
            return
        problem = self._read(record)
        if problem is not None:
            logger.warning("ignoring the exactness probes' outcomes %s: %s; probing again", path, problem)
            self._burst = self._batch = self._split = None

    def split(self, max_rows: int, max_batch: int) -> RowSplit | None:
        """The row split stored for this fingerprint, measured for exactly *max_rows* positions and
        *max_batch* rows; None: measure it."""
        kept = self._split
        if kept is None or (kept["max_rows"], kept["max_batch"]) != (max_rows, max_batch):
            return None
        return RowSplit({(o, i): n for o, i, n in kept["chunks"]}, kept["share"], max_rows, max_batch,
                        kept["steps"], frozenset((o, i) for o, i in kept["batch_shapes"]),
                        {(o, i): n for o, i, n in kept["pads"]}, {(o, i): (t, n) for o, i, t, n in kept["tiles"]})

    def save_split(self, split: RowSplit) -> None:
        """Keep *split*, measured at this start (the probes' outcomes, measured after it, are dropped)."""
        self._burst = self._batch = None
        self._split = {"chunks": sorted([*shape, n] for shape, n in split.chunks.items()),
                       "pads": sorted([*shape, n] for shape, n in split.pads.items()),
                       "tiles": sorted([*shape, *layout] for shape, layout in split.tiles.items()),
                       "batch_shapes": sorted(list(shape) for shape in split.batch_shapes), "share": split.share,
                       "max_rows": split.max_rows, "max_batch": split.max_batch, "steps": split.steps}
        self._save()

    def burst(self) -> ProbeResult | None:
        """The burst's probe outcome stored for this fingerprint, or None: probe."""
        return self._burst

    def save_burst(self, result: ProbeResult) -> None:
        """Keep the burst's probe *result* (its batch widths are probed again: the burst's comes first)."""
        self._burst, self._batch = result, None
        self._save()

    def batch(self, widths: range) -> dict[int, str] | None:
        """The batch's declined widths stored for exactly *widths*, or None: probe them."""
        if self._batch is None or self._batch["widths"] != [widths.start, widths.stop]:
            return None
        return {int(width): detail for width, detail in self._batch["declined"].items()}

    def save_batch(self, widths: range, declined: dict[int, str]) -> None:
        self._batch = {"widths": [widths.start, widths.stop],
                       "declined": {str(width): detail for width, detail in sorted(declined.items())}}
        self._save()

    def _read(self, record: dict[str, Any]) -> str | None:
        burst, batch, split = record.get("burst"), record.get("batch"), record.get("split")
        if set(record) != {"fingerprint", "split", "burst", "batch"}:
            return "its fields are not those of the probes' outcomes"
        if split is not None:
            problem = _split_problem(split)
            if problem is not None:
                return problem
            self._split = split
        if burst is not None:
            if not (isinstance(burst, dict) and set(burst) == {"split", "detail"}
                    and (burst["split"] is None or (isinstance(burst["split"], str) and burst["split"] in DESCRIBE))
                    and (burst["detail"] is None or isinstance(burst["detail"], str))
                    and (burst["split"] is None) != (burst["detail"] is None)):
                return "its burst is not a split or a veto"
            self._burst = ProbeResult(burst["split"], burst["detail"])
        if batch is not None:
            widths, declined = (batch.get("widths"), batch.get("declined")) if isinstance(batch, dict) else (0, 0)
            if not (isinstance(widths, list) and len(widths) == 2 and all(type(w) is int for w in widths)
                    and isinstance(declined, dict)
                    and all(k.isascii() and k.isdigit() and isinstance(v, str) for k, v in declined.items())):
                return "its batch is not widths and their declines"
            self._batch = batch
        return None

    def _save(self) -> None:
        burst = None if self._burst is None else {"split": self._burst.split, "detail": self._burst.detail}
        self._hints.save_probe(self._key, {"fingerprint": self._fingerprint, "split": self._split, "burst": burst,
                                           "batch": self._batch})


def _split_problem(split: Any) -> str | None:
    """What is wrong with a stored row split, or None."""
    def shapes(value: Any, width: int) -> bool:
        return isinstance(value, list) and all(
            isinstance(v, list) and len(v) == width and all(type(n) is int and n > 0 for n in v) for v in value)

    if not (isinstance(split, dict) and set(split) == {"chunks", "pads", "tiles", "batch_shapes", "share",
                                                        "max_rows", "max_batch", "steps"}
            and shapes(split["chunks"], 3) and shapes(split["pads"], 3) and shapes(split["tiles"], 4)
            and shapes(split["batch_shapes"], 2)
            and type(split["share"]) in (int, float) and type(split["max_rows"]) is int
            and type(split["max_batch"]) is int and type(split["steps"]) is bool):
        return "its row split is not one"
    return None


def fingerprint(target: Path, drafter: Path, settings: Mapping[str, object]) -> dict[str, str]:
    """What the probes' bytes (and the row split's) depend on besides the pairing key and the kernels' versions
    (module docstring): *target* and *drafter* the served files, *settings* those that reach the probed
    forward."""
    import mlx.core as mx

    from .. import blas

    return {
        **_builds(),
        "blas": blas.load_fast_blas(),
        "machine": f"{platform.platform()} {platform.machine()} {_cpu()}",
        "device": f"{mx.default_device()} {_device_info()}",
        "libraries": _libraries(),
        "environment": repr(sorted((name, value) for name, value in os.environ.items()
                                   if name.startswith(_KERNEL_ENVIRONMENT))),
        "target": _files_digest(target, "**/*"),
        "drafter": _files_digest(drafter, "**/*"),
        "settings": repr(sorted(settings.items())),
    }


@functools.cache
def _builds() -> dict[str, str]:
    """The mlxcel, mlx and mlx-lm builds, by their files: walked once a process (a few thousand files: ~0.05 s
    a start, and a fleet's process starts a model each time it loads one). The code a process runs is what it
    imported, so a file edited since is not in it; the next process takes the edit."""
    import mlx
    import mlx_lm

    return {
        "mlxcel": _files_digest(Path(__file__).resolve().parent.parent, "**/*.py"),
        "mlx": _files_digest(Path(next(iter(mlx.__path__))), "**/*"),  # a development build keeps its version
        "mlx-lm": _files_digest(Path(next(iter(mlx_lm.__path__))), "**/*.py"),
    }


def _files_digest(path: Path, pattern: str = "*") -> str:
    """A digest of the names, sizes and modification times of *path* (a file) or of its files matching
    *pattern* (a directory): cheap, and changed by any rewrite."""
    if path.is_file():
        return _stat_digest([(path.name, path)])
    return _stat_digest((str(p.relative_to(path)), p) for p in sorted(path.glob(pattern)) if p.is_file())


def _stat_digest(files: Iterable[tuple[str, Path]], missing_ok: bool = False) -> str:
    """A digest of each (name, file)'s name, size and modification time; *missing_ok*: a file gone is left
    out (else its ``OSError`` is raised)."""
    digest = hashlib.sha256()
    for name, file in files:
        try:
            status = file.stat()
        except OSError:
            if missing_ok:
                continue
            raise
        digest.update(f"{name}\0{status.st_size}\0{status.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:32]


def _device_info() -> str:
    """What MLX says of its default device (a GPU's name and architecture), where it says anything."""
    import mlx.core as mx

    for info in (getattr(mx, "device_info", None), getattr(getattr(mx, "metal", None), "device_info", None)):
        if callable(info):
            try:
                return repr(sorted(info().items()))
            except Exception:
                continue
    return ""


def _libraries() -> str:
    """The loaded BLAS and MLX library files, each with its size and modification time (Linux)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    mapped = (fields[5] for line in maps.splitlines() if len(fields := line.split(None, 5)) == 6)
    paths = sorted({path for path in mapped if any(k in path.rsplit("/", 1)[-1].lower() for k in _KERNEL_FILES)})
    return _stat_digest(((path, Path(path)) for path in paths), missing_ok=True)  # "(deleted)": a file replaced


def _cpu() -> str:
    """The CPU's model name and feature flags (Linux), else what :mod:`platform` says."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    fields = {name.strip(): value.strip() for name, _, value in
              (line.partition(":") for line in text.split("\n\n", 1)[0].splitlines())}
    # The BLAS picks its kernels by the CPU's family, model and features.
    named = " ".join(fields.get(name, "?") for name in ("vendor_id", "cpu family", "model", "stepping", "model name"))
    return f"{named} flags {hashlib.sha256(fields.get('flags', '').encode()).hexdigest()[:16]}"
