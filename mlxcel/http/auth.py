"""API keys: ``Authorization: Bearer KEY`` or ``X-Api-Key: KEY``, compared in constant time."""

from __future__ import annotations

import hmac
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from ..page import PUBLIC_FILES

#: The only paths answered without a key: these, and the page's files (which hold no data: the page asks for its
#: data with the key, :mod:`mlxcel.page`).
PUBLIC_PATHS = frozenset({"/", "/health", "/v1/health"}) | PUBLIC_FILES


def is_public(path: str) -> bool:
    """Whether *path* is answered without a key."""
    return path in PUBLIC_PATHS


class KeyFileError(ValueError):
    """The key file cannot be used; ``str()`` is one line saying why."""


#: A key file is a few lines; a larger one is a mistake (a model file, a log).
_MAX_KEY_FILE_BYTES = 1024 * 1024


def _read_key_file(path: Path) -> str:
    """The file's text. Opened non-blocking and checked to be a regular file, so a FIFO cannot hang startup."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise KeyFileError(f"cannot read --api-key-file {path}: {exc.strerror or exc}") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise KeyFileError(f"--api-key-file {path} is not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(_MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise KeyFileError(f"cannot read --api-key-file {path}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)
    if len(data) > _MAX_KEY_FILE_BYTES:
        raise KeyFileError(f"--api-key-file {path} is larger than {_MAX_KEY_FILE_BYTES} bytes; "
                           "expected one key per line")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KeyFileError(f"--api-key-file {path} is not UTF-8 text (byte {exc.start})") from exc


def read_keys(inline: Iterable[str] = (), key_file: Path | None = None) -> tuple[str, ...]:
    """Keys from comma lists and from a file (one per line, ``#`` comments).

    :class:`KeyFileError` if the file is unusable, or if keys were asked for and none was given (a server
    that would then be open to everyone).
    """
    inline = list(inline)
    keys = [k.strip() for item in inline for k in item.split(",")]
    if key_file is not None:
        for line in _read_key_file(key_file).splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                keys.append(line)
    found = tuple(k for k in keys if k)
    if (inline or key_file is not None) and not found:
        raise KeyFileError("--api-key/--api-key-file given, but no key in them")
    return found


def credential(authorization: str | None, x_api_key: str | None) -> str | None:
    if authorization:
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    return x_api_key.strip() if x_api_key else None


def key_matches(presented: str | None, keys: tuple[str, ...]) -> bool:
    """True if *presented* is one of *keys*. Every key is compared, in constant time each."""
    given = (presented or "").encode("utf-8")
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(given, key.encode("utf-8"))
    return matched and presented is not None
