"""What the disk tier's files share: kept private, opened without blocking, and checked against a checksum.

The prefix cache's disk tier (:mod:`.prompt_disk`) keeps prompts (their token
ids in each file's header, their KV state in its arrays) across restarts: its
directories are made ``0700`` and its files ``0600``, so that no other local
user reads what the server was sent. Worker thread only, but for
:func:`make_private` and :func:`crc32`, which the writer's thread
(:mod:`.disk_writes`) calls too.
"""

from __future__ import annotations

import logging
import os
import stat
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)

PRIVATE_DIRECTORY = 0o700
PRIVATE_FILE = 0o600


def private_directory(path: Path) -> None:
    """Make *path* (and any missing parent) a directory only its owner can enter; one that exists open to
    others is closed, with a warning that says so. Raises OSError when it cannot be made."""
    path.mkdir(mode=PRIVATE_DIRECTORY, parents=True, exist_ok=True)
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        logger.warning("%s was open to other users (mode %o) and holds prompts: made %o", path, mode,
                       PRIVATE_DIRECTORY)
        path.chmod(PRIVATE_DIRECTORY)


def make_private(path: Path) -> None:
    """Make the file *path* readable by its owner only (before it is renamed to where it is found)."""
    os.chmod(path, PRIVATE_FILE)


def open_regular(path: Path) -> IO[bytes] | None:
    """*path* opened for reading, or None if it is not a regular file.

    Opened non-blocking and checked before reading: a FIFO named like an entry
    would otherwise block the open for ever, and the start with it.
    O_NONBLOCK changes nothing for a regular file.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def is_regular(path: Path) -> bool:
    """Whether *path* is a regular file (following a link, as reading it would)."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False


def checksum(arrays: Mapping[str, Any]) -> str:
    """CRC-32 of *arrays*' bytes, in the order of their names, as hex (MLX arrays: worker thread).

    For damage, not for an attacker (one who can write the file can write its
    checksum): a flipped bit, a block of zeros or of noise, arrays scaled under
    an intact header. CRC-32 because it runs at a few GB/s on one core (the cost
    per GB is in docs/benchmarks.md); each array is made contiguous on its own,
    so at most one array is copied at a time.
    """
    import mlx.core as mx

    return crc32((name, memoryview(mx.contiguous(arrays[name]))) for name in sorted(arrays))  # type: ignore[arg-type]


def crc32(buffers: Iterable[tuple[str, Any]]) -> str:
    """CRC-32 of each (name, bytes) in turn, the name's bytes first, as hex (any thread: no MLX)."""
    crc = 0
    for name, data in buffers:
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(data, crc)
    return f"{crc:08x}"
