"""What the disk tier's files share: kept private, opened without blocking, and checked against a checksum.

The prefix cache's disk tier (:mod:`.prompt_disk`) keeps prompts (their token
ids in each file's header, their KV state in its arrays) across restarts: its
directories are made ``0700`` and its files ``0600``, so that no other local
user reads what the server was sent. Worker thread only, but for
:func:`make_private` and :func:`crc32`, which the writer's thread
(:mod:`.disk_writes`) calls too, and :func:`file_checksum`, which the disk
tier's reader thread calls.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import stat
import struct
import zlib
from collections.abc import Callable, Collection, Iterable, Mapping
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)

PRIVATE_DIRECTORY = 0o700
PRIVATE_FILE = 0o600
MAX_HEADER = 64 << 20
"""The largest safetensors header read (a prompt's token ids are in it): past it a file is damaged."""
_READ_CHUNK = 8 << 20
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F16": 2, "BF16": 2, "I16": 2, "U16": 2,
             "F32": 4, "I32": 4, "U32": 4, "F64": 8, "I64": 8, "U64": 8, "C64": 8}
"""Bytes an element of each safetensors dtype takes."""

Identity = tuple[int, int, int, int]
"""A file's (device, inode, size, modification time in ns): the disk tier writes a file once and renames it
into place, so a path with the same identity holds the same bytes."""


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


def lock_directory(directory: Path) -> int | None:
    """An exclusive advisory lock on *directory*'s lock file, held while the descriptor is open; None when
    another process (or another server in this one) holds it."""
    fd = os.open(directory / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def file_size(path: Path) -> int:
    """*path*'s size in bytes; 0 where there is no such file."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


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


def identity(path: Path) -> Identity | None:
    """*path*'s :data:`Identity`, or None if it cannot be read."""
    try:
        return _identity(path.stat())
    except OSError:
        return None


def _identity(status: os.stat_result) -> Identity:
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns


def file_checksum(path: Path, skip: Callable[[dict[str, str]], Collection[str]] = lambda metadata: ()
                  ) -> tuple[str, dict[str, str], Identity]:
    """(the CRC-32 :func:`checksum` gives the arrays of the safetensors file at *path*, read from their bytes in
    the file; the file's metadata; its :data:`Identity`). *skip*: the names, given the metadata, left out of
    the sum. Any thread (no MLX: the sum reads the file a chunk at a time, so it also fills the page cache the
    worker's ``mx.load`` then reads from). Raises OSError or ValueError for a file that is not one."""
    opened = open_regular(path)
    if opened is None:
        raise ValueError("not a regular file")
    with opened as file:
        head = file.read(8)
        if len(head) < 8:
            raise ValueError("no header")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER:
            raise ValueError(f"a header of {length} bytes")
        header = json.loads(file.read(length))
        metadata = header.pop("__metadata__", None) or {}
        skipped = set(skip(metadata))
        fd, start = file.fileno(), 8 + length
        buffer = bytearray(_READ_CHUNK)
        view = memoryview(buffer)
        crc = 0
        for name in sorted(name for name in header if name not in skipped):
            begin, end = (int(offset) for offset in header[name]["data_offsets"])
            if end - begin != math.prod(header[name]["shape"]) * _ITEMSIZE[header[name]["dtype"]]:
                raise ValueError(f"{name}'s bytes do not match its shape and dtype")  # mx.load would read others
            crc = zlib.crc32(name.encode(), crc)
            while begin < end:
                read = os.preadv(fd, [view[:min(_READ_CHUNK, end - begin)]], start + begin)
                if read <= 0:
                    raise ValueError(f"cut short in {name}")
                crc = zlib.crc32(view[:read], crc)
                begin += read
        return f"{crc:08x}", metadata, _identity(os.fstat(fd))
