"""The disk tier's reads: an entry's files summed ahead on the reader thread, then loaded by the worker.

A hit on the prefix cache's disk tier (:mod:`.prompt_disk`) was read whole in
the worker's turn: the file from disk, then every array's bytes through
CRC-32, while no row of the batch stepped (0.34 s for a 547 MB entry with its
page cache warm, docs/benchmarks.md). Now an arrival whose prompt an entry on
disk serves waits, before the scheduler sees it (:mod:`.read_ahead`), while
:func:`checked` reads that entry's files here, a chunk at a time, and sums
them (no MLX there); the worker then loads (:func:`load_cache`) a file whose
bytes were found whole, which the read has just been through, and sums it
again only if it changed since.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import drafter_disk
from .disk_files import Identity, checksum, file_checksum
from .prefix_cache import rewindable


def numbers(metadata: dict[str, str]) -> set[str]:
    """The names of a prompt cache file's arrays that stand for its layers' numbers and strings, which the
    checksum leaves out (mlx-lm's layout: its metadata's third tree lists them)."""
    from mlx.utils import tree_unflatten  # pure Python: no array is made

    _, _, scalars = tree_unflatten(list(metadata.items()))
    return {position for position, _ in scalars[1:]}


def checked(path: Path, expected: str, drafter: Path | None) -> tuple[Identity | None, Identity | None]:
    """The reader thread's job (no MLX): the entry's file and the drafter's beside it summed; each one's
    :data:`Identity` where its checksum matched, None where it did not, or it could not be read (the worker's
    own read then finds why)."""
    entry = _matching(lambda: file_checksum(path, numbers), lambda metadata: expected)
    beside = _matching(lambda: file_checksum(drafter), lambda metadata: metadata.get(drafter_disk.CHECKSUM_KEY)) \
        if drafter is not None else None
    return entry, beside


def _matching(summed: Callable[[], tuple[str, dict[str, str], Identity]],
              expected: Callable[[dict[str, str]], str | None]) -> Identity | None:
    try:
        found, metadata, file = summed()
        return file if found == expected(metadata) else None
    except Exception:  # whatever a damaged file makes the reading raise: the worker's own read says what
        return None


def load_cache(path: Path, expected: str, verified: bool, classes: dict[str, Any], layers: list[type[Any]], tokens: int,
               rewinds: bool) -> list[Any]:
    """The cache in the prompt cache file at *path* (worker thread): mlx-lm's ``load_prompt_cache``, with the
    classes this model's family uses (mlx-lm's looks classes up among its own only), checked against the
    model's *layers* (see :func:`cache_from`), and its arrays against their checksum *expected* unless
    *verified* (the read ahead did, on these bytes)."""
    import mlx.core as mx

    loaded: Any = mx.load(str(path), return_metadata=True)
    arrays, flat = loaded
    if not verified:
        skipped = numbers(flat)
        found = checksum({name: array for name, array in arrays.items() if name not in skipped})
        if found != expected:
            raise ValueError(f"its arrays' checksum is {found}, where its header says {expected}")
    cache = cache_from(arrays, flat, classes, layers, tokens, rewinds)
    mx.eval([layer.state for layer in cache])
    return cache


def cache_from(arrays: dict[str, Any], flat: dict[str, str], classes: dict[str, Any], layers: list[type[Any]],
               tokens: int, rewinds: bool) -> list[Any]:
    """The cache laid out in *arrays* and *flat* (a file's arrays and metadata, or those made ready to be
    written), of *classes*, checked against the model's *layers* (their classes), the *tokens* it holds and
    whether it *rewinds*."""
    from mlx.utils import tree_unflatten

    _, names, scalars = tree_unflatten(list(flat.items()))
    values: dict[str, Any] = dict(arrays)
    for position, kind in scalars[1:]:
        array = arrays[position]
        values[position] = array.item() if kind == "scalar" else None if kind == "none" else \
            "".join(chr(c) for c in array.tolist())
    states = tree_unflatten(list(values.items()))
    if len(names) != len(layers) or len(states) != len(names):
        raise ValueError(f"{len(names)} layers, where the model has {len(layers)}")
    cache = [classes[name].from_state(state) for name, state in zip(names, states, strict=True)]
    for layer, fresh in zip(cache, layers, strict=True):
        if not isinstance(layer, fresh):  # a family's own class is a kind of mlx-lm's, or the same class
            raise ValueError(f"a {type(layer).__name__} layer where the model has a {fresh.__name__}")
        if getattr(layer, "offset", tokens) != tokens:
            raise ValueError(f"a layer holding {layer.offset} positions for {tokens} tokens")
    if rewindable(cache) != rewinds:
        raise ValueError("its layers do not match its header")
    return cache
