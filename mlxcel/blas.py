"""Load a fast BLAS before mlx, on Linux.

The ``mlx[cpu]`` wheel links a bundled reference BLAS. Loading the system
OpenBLAS with ``RTLD_GLOBAL`` *before* mlx is imported makes mlx's fp32
``cblas_sgemm`` calls resolve to it (architecture section 9: a 1024x1024 fp32
matmul went from ~300 ms to ~10 ms here). It must happen before the first
``import mlx``, so this module imports nothing heavy and the CLI calls it first.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

#: Where Debian's ``libopenblas0-pthread`` (and most distributions) put it.
CANDIDATES = ("libopenblas.so.0", "libopenblas.so")


_chosen: str | None = None


class BlasError(ValueError):
    """``MLXCEL_BLAS`` names something that cannot be loaded."""


def load_fast_blas(setting: str | None = None) -> str:
    """Load the BLAS ``MLXCEL_BLAS`` asks for and say which one mlx will use.

    *setting* is ``auto`` (default: the system OpenBLAS when present), ``off``
    (mlx's bundled reference BLAS), or a path to a BLAS shared library. Returns
    a short description for the startup log.
    """
    global _chosen
    if _chosen is not None:
        return _chosen  # a BLAS is chosen once per process, before mlx loads
    _chosen = _choose(setting)
    return _chosen


def _choose(setting: str | None) -> str:
    value = (setting if setting is not None else os.environ.get("MLXCEL_BLAS", "")).strip() or "auto"
    if value.lower() == "off":
        return "reference (mlx bundled; MLXCEL_BLAS=off)"
    if sys.platform != "linux":
        if value.lower() == "auto":
            return "platform default"
        raise BlasError(f"MLXCEL_BLAS={value!r} is not valid here: a BLAS path only applies on Linux")
    if "mlx.core" in sys.modules:
        logger.warning("mlx was imported before the BLAS was chosen; MLXCEL_BLAS has no effect")
    if value.lower() == "auto":
        for name in CANDIDATES:
            try:
                ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            return f"OpenBLAS ({ctypes.util.find_library('openblas') or name})"
        return "reference (mlx bundled; no system OpenBLAS found, install libopenblas0-pthread)"
    path = Path(value).expanduser()
    try:
        ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        raise BlasError(f"MLXCEL_BLAS={value!r} is not valid: expected auto, off, or the path of a "
                        f"loadable BLAS library ({exc})") from exc
    return f"{path.name} ({path})"
