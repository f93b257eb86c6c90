"""The prefix cache's disk tier: prompt caches that outlive the server, read back on a hit.

One file per entry, ``<sha256 of its tokens>.safetensors`` under a directory of
its own per model (the model's identity: its config and its weight files'
names, sizes and times), laid out as mlx-lm's ``save_prompt_cache`` lays it
out with the tokens it holds in its metadata, and written by a thread of its
own (:mod:`.disk_writes`: an eviction holds the batch for the hand-over, not
the write), to a temporary name first and then renamed (atomic, as the policy
hints are). An entry is listed once it is handed over; a prompt it serves
before its write is done resumes from the arrays the write is made from. At
start the files' headers are read (not their arrays) to know what is there. An
arrival's entry is read and checked ahead, off the worker's turn
(:meth:`DiskTier.check_ahead`, on a reader thread of the tier's), so that the
hit itself only loads a file already found whole. The tier is bounded by
``--prompt-cache-disk-bytes``: the least recently used files go first.

A file that is not ours, is foreign to this model, truncated, corrupt or
unreadable is a warning and a miss, never a crash or a wrong answer: a damaged
file of ours is removed, a foreign one left alone. Damage under an intact
header is found by the arrays' checksum, stored in the header and checked on
every read; anything that is not a regular file (a FIFO named like an entry)
is skipped unopened. A directory that cannot be written turns the tier off,
with a warning. The tier keeps prompts: its directories are ``0700``, its files
``0600`` (:mod:`.disk_files`). One process owns a model's directory at a time
(an advisory lock): a second server on the same cache root runs without the
disk tier, and says so, rather than delete the first one's entries to fit its
own bound. Worker thread only (the writer's and the reader's threads run only
what they are handed).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import struct
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..models.loader import CheckpointInfo
from . import drafter_disk
from .disk_files import (
    MAX_HEADER,
    Identity,
    file_size,
    identity,
    lock_directory,
    open_regular,
    private_directory,
)
from .disk_reads import cache_from, checked, load_cache
from .disk_writes import Writer, cache_tensors, write
from .messages import WorkerSettings
from .prefix_cache import PrefixCache, best_for, rewindable

logger = logging.getLogger(__name__)

FORMAT = "2"
"""2: the arrays' checksum in the header (files of format 1 are not read, and are left alone)."""
MAX_PENDING_BYTES = 256 << 20
"""Bytes of evicted entries held in memory at most while they wait for the writer (past it a save waits)."""


def model_identity(checkpoint: CheckpointInfo, kv_bits: int | None = None) -> str:
    """What a cache file must have been made by: the model's config and its weight files, as they are now,
    and the KV cache's precision (``--kv-bits``)."""
    digest = hashlib.sha256(json.dumps(checkpoint.config, sort_keys=True).encode())
    if kv_bits is not None:
        digest.update(f"kv_bits:{kv_bits}".encode())
    for weights in sorted(checkpoint.weight_files):
        stat = weights.stat()
        digest.update(f"{weights.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def open_prefix_cache(settings: WorkerSettings, checkpoint: CheckpointInfo, layers: list[Any]) -> PrefixCache:
    """The worker's prefix cache, with its disk tier where the settings give it room and a directory;
    *layers*: a fresh cache of the model (what a file's layers must match)."""
    from mlx_lm.models import cache as mlx_cache

    from ..families import family

    disk = None
    if settings.cache_root is not None and settings.prefix_cache_disk_bytes > 0 and \
            settings.prefix_cache_entries != 0:
        identity = model_identity(checkpoint, settings.kv_bits)
        classes = {name: c for name, c in vars(mlx_cache).items()
                   if isinstance(c, type) and issubclass(c, mlx_cache._BaseCache)}
        classes.update({c.__name__: c for c in family(checkpoint.model_type).cache_classes()})
        drafter = None if settings.drafter is None else f"{settings.drafter.name}|q{settings.draft_quantize}"
        disk = DiskTier(settings.cache_root / "prompt-cache" / f"{checkpoint.name}-{identity[:16]}",
                        settings.prefix_cache_disk_bytes, identity, classes, layers, drafter)
    return PrefixCache(settings.prefix_cache_entries, checkpoint.model_type, settings.prefix_cache_bytes, disk)


def _name(tokens: np.ndarray) -> str:
    return hashlib.sha256(tokens.astype("<i8").tobytes()).hexdigest() + ".safetensors"


@dataclass
class _Record:
    path: Path
    tokens: np.ndarray
    rewinds: bool
    size: int
    used: float
    checksum: str
    """The arrays' checksum in the file's header ("" while the write is pending: the file has it)."""
    pending: Future[str | None] | None = None
    """The write, while the writer has not finished it."""
    tensors: Any = None
    """What the write reads (the entry's and the drafter's :class:`.disk_writes.Tensors`), held until it is done."""
    held: tuple[list[Any], Any] | None = None
    """The cache and the drafter's (token, state) over the arrays being written, until the write is done: a prompt
    the entry serves meanwhile resumes from them, not from the file once written."""
    checked: Future[tuple[Identity | None, Identity | None]] | None = None
    """The read ahead (:meth:`DiskTier.check_ahead`): the entry's and the drafter's files as they were when their
    checksums matched (None: did not)."""


class DiskTier:
    """Entries on disk under *directory*, within *max_bytes*; *classes*: the cache classes a file may name,
    *layers*: a fresh cache of the model (what a file's layers must match)."""

    def __init__(self, directory: Path, max_bytes: int, identity: str, classes: dict[str, type],
                 layers: list[Any], drafter: str | None = None) -> None:
        self.directory, self.max_bytes, self.identity = directory, max_bytes, identity
        self.drafter = drafter
        """The MTP drafter's identity (its name and quantization), whose state is kept beside an entry."""
        self._classes: dict[str, Any] = classes
        self._layers = [type(layer) for layer in layers]
        self._records: dict[str, _Record] = {}
        self._writer = Writer(MAX_PENDING_BYTES)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="mlxcel-prompt-cache-read")
        self._lock: int | None = None
        try:
            private_directory(directory.parent)
            private_directory(directory)
            self._lock = lock_directory(directory)
        except OSError as exc:
            logger.warning("prompt cache: no disk tier, %s cannot be made: %s", directory, exc)
            self.max_bytes = 0
            return
        if self._lock is None:
            logger.warning("prompt cache: no disk tier, another mlxcel process uses %s (one process owns a "
                           "model's disk tier at a time)", directory)
            self.max_bytes = 0
            return
        for path in directory.iterdir():
            if path.name.startswith(".") and path.name.endswith(".tmp.safetensors"):
                path.unlink(missing_ok=True)  # a write a stop cut short
            elif path.suffix == ".safetensors" and not path.name.endswith(drafter_disk.SUFFIX):
                self._index(path)
        self._prune()
        if self._records:
            logger.info("prompt cache: %d entries (%.1f MB) on disk in %s", self.entries, self.bytes / 1e6,
                        directory)

    def close(self) -> None:
        """Wait for the writes handed over, then let another process own the directory (the server is
        stopping; the files stay)."""
        self._reader.shutdown(wait=False, cancel_futures=True)  # no reads wait: nothing will be served
        self._writer.close()
        self._reap()
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    @property
    def entries(self) -> int:
        return len(self._records)

    @property
    def bytes(self) -> int:
        return sum(r.size for r in self._records.values())

    def _index(self, path: Path) -> None:
        try:
            opened = open_regular(path)
            if opened is None:
                logger.warning("prompt cache: skipping %s, which is not a regular file", path)
                return
            with opened as file:
                (length,) = struct.unpack("<Q", file.read(8))
                if length > MAX_HEADER:
                    raise ValueError(f"a header of {length} bytes")
                metadata = json.loads(file.read(length)).get("__metadata__") or {}
            if metadata.get("0.mlxcel_model") != self.identity:
                return  # another model's, or not a prompt cache: left alone
            if metadata.get("0.mlxcel_format") != FORMAT:
                raise ValueError(f"format {metadata.get('0.mlxcel_format')}, where this mlxcel writes {FORMAT}")
            tokens = np.asarray(json.loads(metadata["0.mlxcel_tokens"]), dtype=np.int64)
            if tokens.ndim != 1 or not tokens.size or path.name != _name(tokens):
                raise ValueError("its tokens do not match its name")
            stat = path.stat()
            self._records[path.name] = _Record(path, tokens, metadata.get("0.mlxcel_rewinds") == "1",
                                               stat.st_size + file_size(_drafter_path(path)), stat.st_mtime,
                                               str(metadata.get("0.mlxcel_checksum", "")))
        except (OSError, ValueError, KeyError, struct.error) as exc:
            self._damaged(path, exc)

    def _damaged(self, path: Path, exc: BaseException) -> None:
        logger.warning("prompt cache: ignoring and removing %s: %s: %s", path, type(exc).__name__, exc)
        self._records.pop(path.name, None)
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
            _drafter_path(path).unlink(missing_ok=True)

    def check_ahead(self, prompt: np.ndarray, better_than: int) -> Future[Any] | None:
        """Start reading the files of the entry :meth:`fetch` would give for *prompt*, and checking them against
        their checksums, on the reader thread: the read (running or done: one read serves every arrival), None
        when there is nothing to read (no entry, or one still being written, whose arrays are in memory)."""
        best, _ = best_for(self._records.values(), prompt, better_than)
        if best is None or best.pending is not None:
            return None
        if best.checked is None:
            best.checked = self._reader.submit(checked, best.path, best.checksum,
                                               _drafter_path(best.path) if self.drafter is not None else None)
        return best.checked

    def fetch(self, prompt: np.ndarray, better_than: int) -> tuple[np.ndarray, list[Any], Any] | None:
        """The entry on disk standing for more of *prompt* than *better_than* tokens, read: (its tokens, its
        cache, the drafter's (token, state) kept with it or None); None when there is none, or it cannot be
        read. Files :meth:`check_ahead` found whole, and unchanged since, are not checked again."""
        best, _ = best_for(self._records.values(), prompt, better_than)
        if best is not None and best.held is not None:  # being written, or not yet reaped: its arrays are here
            best.used = time.time()
            return best.tokens, *best.held
        self._reap()  # the writes done let go of their arrays
        if best is None or not self._settle(best):
            return None
        found: tuple[Identity | None, Identity | None] = (None, None)
        read = best.checked
        if read is not None and read.done() and not read.cancelled() and read.exception() is None:
            found = read.result()
        try:
            cache = load_cache(best.path, best.checksum, found[0] is not None and found[0] == identity(best.path),
                               self._classes, self._layers, len(best.tokens), best.rewinds)
        except Exception as exc:  # a truncated or corrupt file: whatever mlx or the classes raise
            self._damaged(best.path, exc)
            return None
        drafter_verified = found[1] is not None and found[1] == identity(_drafter_path(best.path))
        drafter = self._drafter_state(best.path, drafter_verified)
        best.used, best.checked = time.time(), None  # the file's new time changes its identity
        with contextlib.suppress(OSError):
            os.utime(best.path)
        return best.tokens, cache, drafter

    def _drafter_state(self, path: Path, verified: bool) -> Any:
        """The drafter's (token, state) beside the entry at *path*, if it is this drafter's and readable
        (*verified*: its checksum matched in the read ahead, and the file is unchanged since)."""
        if self.drafter is None:
            return None
        try:
            return drafter_disk.load(_drafter_path(path), self.drafter, self._classes, verified)
        except Exception as exc:  # damaged: the prompt resumes with a fresh drafter, as without the file
            logger.warning("prompt cache: ignoring the drafter's state beside %s: %s: %s", path.name,
                           type(exc).__name__, exc)
            return None

    def save(self, tokens: np.ndarray, cache: list[Any], drafter: tuple[int, Any] | None = None) -> None:
        """Write *cache*, which holds exactly *tokens*, unless it is there already or the tier is off; and
        *drafter*, the MTP drafter's (token it has read after them, state) kept with it, if any.

        Here the arrays are only made ready; the writer's thread writes them (:mod:`.disk_writes`), and the
        entry is listed at once: a prompt it serves before the write is done resumes from what is written."""
        self._reap()
        name = _name(tokens)
        if self.max_bytes <= 0 or name in self._records:
            return
        path = self.directory / name
        rewinds = rewindable(cache)
        try:
            entry = cache_tensors(cache, {"mlxcel_format": FORMAT, "mlxcel_model": self.identity,
                                           "mlxcel_tokens": json.dumps(tokens.tolist(), separators=(",", ":")),
                                           "mlxcel_rewinds": "1" if rewinds else "0"})
        except Exception as exc:  # state mlx-lm could not serialise either
            logger.warning("prompt cache: could not write %s: %s: %s", path, type(exc).__name__, exc)
            return
        beside = None
        if drafter is not None and self.drafter is not None:
            try:
                beside = drafter_disk.prepare(self.drafter, *drafter)
            except Exception as exc:  # only the drafter's head start is lost
                logger.warning("prompt cache: could not write the drafter's state beside %s: %s: %s", name,
                               type(exc).__name__, exc)
        nbytes = entry.nbytes + (beside.nbytes if beside is not None else 0)
        pending = self._writer.submit(functools.partial(_write, path, [entry, beside]), nbytes)
        held = None  # a prompt it serves before the write is done resumes from the very arrays being written
        with contextlib.suppress(Exception):  # else it waits for the write, and reads the file
            held = (cache_from(entry.arrays, entry.metadata, self._classes, self._layers, len(tokens), rewinds),
                    drafter_disk.decode(beside, self._classes) if beside is not None else None)
        self._records[name] = _Record(path, tokens, rewinds, nbytes, time.time(), "", pending, (entry, beside), held)
        self._prune()

    def _reap(self) -> None:
        """Take in the writes done: a written entry's checksum and size, a failed one's record dropped."""
        for record in [r for r in self._records.values() if r.pending is not None and r.pending.done()]:
            self._settle(record)

    def _settle(self, record: _Record) -> bool:
        """Wait for *record*'s write if it is pending; whether the entry is on disk."""
        if record.pending is None:
            return True
        summed = record.pending.result()
        record.pending = record.tensors = record.held = None  # the arrays are freed here, on the worker's thread
        if summed is None:
            self._records.pop(record.path.name, None)
            return False
        record.checksum = summed
        with contextlib.suppress(OSError):
            record.size = record.path.stat().st_size + file_size(_drafter_path(record.path))
        # Its bytes were summed as they were written: found whole, as a read ahead would find them, while unchanged.
        record.checked = Future()
        record.checked.set_result((identity(record.path), identity(_drafter_path(record.path))))
        return True

    def _prune(self) -> None:
        """Remove the least recently used files until the tier is within its bound."""
        while self._records and self.bytes > self.max_bytes:
            oldest = min(self._records.values(), key=lambda r: r.used)
            self._settle(oldest)
            self._records.pop(oldest.path.name, None)
            try:
                oldest.path.unlink(missing_ok=True)
                _drafter_path(oldest.path).unlink(missing_ok=True)
            except OSError as exc:
                logger.warning("prompt cache: could not remove %s: %s", oldest.path, exc)


def _drafter_path(path: Path) -> Path:
    """Where the drafter's state beside the entry at *path* lives."""
    return path.with_name(path.name.removesuffix(".safetensors") + drafter_disk.SUFFIX)


def _write(path: Path, held: list[Any]) -> str | None:
    """The writer's job: the entry's file, then the drafter's beside it (no MLX here); the entry's checksum,
    or None when it could not be written. *held*: [the entry's tensors, the drafter's or None], emptied
    before anything else, and nothing raised: once the job is done the writer's thread holds no reference to
    the arrays, so that the worker's thread frees them."""
    entry, drafter = held
    held.clear()
    try:
        summed = write(entry, path)
    except Exception as exc:  # a full disk, a directory gone
        logger.warning("prompt cache: could not write %s: %s: %s", path, type(exc).__name__, exc)
        return None
    if drafter is not None:
        try:
            write(drafter, _drafter_path(path))
        except Exception as exc:  # only the drafter's head start is lost
            logger.warning("prompt cache: could not write the drafter's state beside %s: %s: %s", path.name,
                           type(exc).__name__, exc)
    return summed
