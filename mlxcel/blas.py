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
_kind = "reference"


def blas_kind() -> str:
    """Which BLAS mlx's CPU backend uses in this process: ``openblas``, ``reference`` or ``custom``.

    Part of the CPU hardware label: the BLAS changes whether MTP pays off (and
    whether a wide verify is exact), so a verdict must not cross BLAS kinds.
    """
    return _kind


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
    global _kind
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
                library = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            _kind = "openblas"
            return f"OpenBLAS ({ctypes.util.find_library('openblas') or name}, {_set_threads(library)})"
        return "reference (mlx bundled; no system OpenBLAS found, install libopenblas0-pthread)"
    path = Path(value).expanduser()
    try:
        library = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        raise BlasError(f"MLXCEL_BLAS={value!r} is not valid: expected auto, off, or the path of a "
                        f"loadable BLAS library ({exc})") from exc
    _kind = "openblas" if "openblas" in path.name.lower() else "custom"
    return f"{path.name} ({path}, {_set_threads(library)})"


def _set_threads(library: ctypes.CDLL) -> str:
    """Leave one core to the event loop: BLAS threads = usable cores - 1 (at least 1).

    OpenBLAS's threads wait for each other at the end of every matmul; when the
    HTTP thread (or anything else) takes one of their cores mid-matmul, the
    whole decode step stalls. On a 2-core machine, 50 pollers cost decode 14% with
    two BLAS threads and 2% with one (docs/benchmarks.md). ``OPENBLAS_NUM_THREADS``,
    when set, wins.
    """
    if os.environ.get("OPENBLAS_NUM_THREADS"):
        return f"{os.environ['OPENBLAS_NUM_THREADS']} threads (OPENBLAS_NUM_THREADS)"
    setter = getattr(library, "openblas_set_num_threads", None)
    if setter is None:
        return "threads: library default"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores - 1)
    setter(ctypes.c_int(threads))
    return f"{threads} thread{'s' if threads > 1 else ''}"
