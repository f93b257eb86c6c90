"""The disk tier's reads ahead: an entry's files summed on the reader thread, before the worker maps them.

A hit on the prefix cache's disk tier (:mod:`.prompt_disk`) was read whole in
the worker's turn: the file from disk, then every array's bytes through
CRC-32, while no row of the batch stepped (0.34 s for a 547 MB entry with its
page cache warm, docs/benchmarks.md). Now an arrival whose prompt an entry on
disk serves waits, before the scheduler sees it (:mod:`.read_ahead`), while
:func:`checked` reads that entry's files here, a chunk at a time, and sums
them; the worker then maps a file whose bytes were found whole and which the
page cache holds, and checks it again only if it changed since. No MLX here.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .disk_files import Identity, file_checksum


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
    beside = _matching(lambda: file_checksum(drafter), lambda metadata: metadata.get("mlxcel_checksum")) \
        if drafter is not None else None
    return entry, beside


def _matching(summed: Callable[[], tuple[str, dict[str, str], Identity]],
              expected: Callable[[dict[str, str]], str | None]) -> Identity | None:
    try:
        found, metadata, file = summed()
        return file if found == expected(metadata) else None
    except Exception:  # whatever a damaged file makes the reading raise: the worker's own read says what
        return None
