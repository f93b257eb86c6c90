"""The disk tier's files, written by a thread of their own from arrays the worker made ready.

An entry of the prefix cache's disk tier is tens to hundreds of MB (2k tokens
of Qwen3.5-0.8B's layer shapes with the MTP head's state: 35 MB; 8k: 111 MB).
Written in the worker's turn, as mlx-lm's ``save_prompt_cache`` writes it, its
checksum and its write held every row of the batch for 70 ms (335 ms at 8k:
docs/benchmarks.md, ``benchmarks/disk_writes.py``). Here the worker
only makes each array contiguous and evaluated (:func:`ready`: MLX stays on its
one thread) and hands over views of their bytes; :class:`Writer`'s thread sums
them, lays the file out (safetensors, as ``mx.load`` reads it: the header's
length in 8 bytes, a JSON header, the arrays' bytes) and renames it into place.
MLX releases the GIL while it evaluates, and so do zlib and file writes: the
write runs beside the batch's steps, on the machine's other core.

The worker keeps each :class:`Tensors` until its write is done, so that the
arrays are freed on the worker's thread, never on the writer's.
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .disk_files import crc32, make_private

logger = logging.getLogger(__name__)
T = TypeVar("T")

_DTYPES = {"bool": "BOOL", "uint8": "U8", "uint16": "U16", "uint32": "U32", "uint64": "U64", "int8": "I8",
           "int16": "I16", "int32": "I32", "int64": "I64", "float16": "F16", "bfloat16": "BF16", "float32": "F32",
           "float64": "F64", "complex64": "C64"}
"""MLX's dtypes by their safetensors names (the names ``mx.save_safetensors`` writes and ``mx.load`` reads)."""


@dataclass
class Tensors:
    """Arrays ready to be written without MLX: *arrays* (name -> MLX array, contiguous and evaluated, held
    only to keep *views* of their bytes alive), each one's safetensors *header* entry (dtype and shape), the
    file's *metadata*; the checksum of the arrays named in *summed* (in that order) goes into the metadata
    under *checksum_key* when the file is written."""

    arrays: dict[str, Any]
    views: dict[str, memoryview]
    header: dict[str, dict[str, Any]]
    metadata: dict[str, str]
    summed: tuple[str, ...]
    checksum_key: str

    @property
    def nbytes(self) -> int:
        return sum(view.nbytes for view in self.views.values())


def ready(arrays: dict[str, Any], metadata: dict[str, str], checksum_key: str,
          summed: Iterable[str] | None = None) -> Tensors:
    """*arrays* made ready to be written by another thread (worker thread: this calls MLX); *summed*: the
    names the checksum covers (all of them, by default), summed in sorted order."""
    import mlx.core as mx

    contiguous = {name: mx.contiguous(array) for name, array in arrays.items()}
    mx.eval(list(contiguous.values()))
    header = {}
    for name, array in contiguous.items():
        dtype = _DTYPES.get(str(array.dtype).removeprefix("mlx.core."))
        if dtype is None:
            raise TypeError(f"{name} is of {array.dtype}, which safetensors has no name for")
        header[name] = {"dtype": dtype, "shape": list(array.shape)}
    views = {name: memoryview(array).cast("B") for name, array in contiguous.items()}  # type: ignore[arg-type]
    return Tensors(contiguous, views, header, metadata, tuple(sorted(arrays if summed is None else summed)),
                   checksum_key)


def cache_tensors(cache: list[Any], metadata: dict[str, str]) -> Tensors:
    """*cache* made ready to be written (worker thread), laid out as mlx-lm's ``save_prompt_cache`` lays it
    out, so that its ``load_prompt_cache`` reads the file: each layer's state flattened, numbers, strings and
    ``None`` turned into arrays and listed apart; in the header *metadata*, the layers' classes and that list.
    The checksum covers the state's own arrays."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    scalars: list[Any] = [""]  # never empty: tree_flatten would drop it
    arrays: dict[str, Any] = {}
    flat: list[tuple[str, Any]] = tree_flatten([layer.state for layer in cache])  # type: ignore[assignment]
    for name, value in flat:
        if isinstance(value, mx.array):
            arrays[name] = value
        elif isinstance(value, bool | int | float):
            scalars.append((name, "scalar"))
            arrays[name] = mx.array(value)
        elif isinstance(value, str):
            scalars.append((name, "string"))
            arrays[name] = mx.array([ord(char) for char in value])
        elif value is None:
            scalars.append((name, "none"))
            arrays[name] = mx.array([])
        else:
            raise ValueError(f"Model state is not serializable: {value}")
    numbers = {name for name, _ in scalars[1:]}
    header = dict(tree_flatten([metadata, [type(layer).__name__ for layer in cache], scalars]))
    return ready(arrays, header, checksum_key="0.mlxcel_checksum", summed=[a for a in arrays if a not in numbers])


def write(tensors: Tensors, path: Path) -> str:
    """Write *tensors* to *path* (any thread: no MLX), through a temporary name beside it
    (``.<name>.tmp.safetensors``, which a start removes if a stop cut the write short), made private
    before it is renamed into place; the checksum written. Raises what the write raises, the temporary file
    removed."""
    summed = crc32((name, tensors.views[name]) for name in tensors.summed)
    metadata = {**tensors.metadata, tensors.checksum_key: summed}
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, view in tensors.views.items():
        header[name] = {**tensors.header[name], "data_offsets": [offset, offset + view.nbytes]}
        offset += view.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the arrays start 8-byte aligned, as the format recommends
    temporary = path.with_name(f".{path.name.removesuffix('.safetensors')}.tmp.safetensors")
    try:
        with open(temporary, "wb") as file:
            file.write(struct.pack("<Q", len(encoded)))
            file.write(encoded)
            for view in tensors.views.values():
                file.write(view)
        make_private(temporary)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return summed


class Writer:
    """One thread that runs writes in the order they are handed over; :meth:`close` waits for them all.

    The worker holds what it handed over (the arrays) until their write is done, which bounds memory: past
    *max_pending_bytes* waiting, :meth:`submit` first waits for the oldest writes (one write always waits,
    however large)."""

    def __init__(self, max_pending_bytes: int) -> None:
        self.max_pending_bytes = max_pending_bytes
        self._executor: ThreadPoolExecutor | None = None
        self._pending: list[tuple[Future[Any], int]] = []

    def submit(self, job: Callable[[], T], nbytes: int) -> Future[T]:
        """Run *job* on the writer's thread after the writes before it; *nbytes*: what it holds in memory."""
        self._pending = [(future, size) for future, size in self._pending if not future.done()]
        while self._pending and sum(size for _, size in self._pending) + nbytes > self.max_pending_bytes:
            future, _ = self._pending.pop(0)
            future.exception()  # waits (a job reports its own failures)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxcel-disk-writer")
        future = self._executor.submit(job)
        self._pending.append((future, nbytes))
        return future

    def close(self) -> None:
        """Wait for every write handed over (the server is stopping)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._pending.clear()
