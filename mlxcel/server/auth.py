"""API keys: ``Authorization: Bearer KEY`` or ``X-Api-Key: KEY``, compared in constant time."""

from __future__ import annotations

import hmac
from collections.abc import Iterable
from pathlib import Path

#: The only paths answered without a key.
PUBLIC_PATHS = frozenset({"/", "/health", "/v1/health"})


def read_keys(inline: Iterable[str] = (), key_file: Path | None = None) -> tuple[str, ...]:
    """Keys from comma lists and from a file (one per line, ``#`` comments)."""
    keys = [k.strip() for item in inline for k in item.split(",")]
    if key_file is not None:
        for line in key_file.read_text(encoding="utf-8").splitlines():
            line = line.split("#", 1)[0].strip()
            if line:
                keys.append(line)
    return tuple(k for k in keys if k)


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
