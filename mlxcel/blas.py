"""Load a fast BLAS before mlx, on Linux.

The ``mlx[cpu]`` wheel links a bundled reference BLAS. Loading the system
OpenBLAS with ``RTLD_GLOBAL`` *before* mlx is imported makes mlx's fp32
``cblas_sgemm`` calls resolve to it (architecture section 9: a 1024x1024 fp32
matmul went from ~300 ms to ~10 ms here). It must happen before the first
``import mlx``, so this module imports nothing heavy and the CLI calls it first.

``MLXCEL_BLAS=mkl`` loads Intel MKL from the ``mkl`` wheel instead
(``pip install 'mlxcel[mkl]'``). mlx calls ``cblas_sgemm`` for every matmul,
a B=1 decode step's (1, K) x (K, N) ones included; OpenBLAS packs the whole
weight matrix for those, so decode reads weights at a quarter of the memory
bandwidth, where MKL reads them at nearly all of it (docs/benchmarks.md,
issue 16). It is not the default: the wheel weighs ~1 GB installed.
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

#: MKL's single dynamic library, as the ``mkl`` wheel installs it (into the environment's ``lib/``).
MKL_PATTERN = "libmkl_rt.so*"


_chosen: str | None = None
_kind = "reference"


def blas_kind() -> str:
    """Which BLAS mlx's CPU backend uses in this process: ``openblas``, ``mkl``, ``reference`` or ``custom``.

    Part of the CPU hardware label: the BLAS changes whether MTP pays off (and
    whether a wide verify is exact), so a verdict must not cross BLAS kinds.
    """
    return _kind


class BlasError(ValueError):
    """``MLXCEL_BLAS`` names something that cannot be loaded."""


def load_fast_blas(setting: str | None = None) -> str:
    """Load the BLAS ``MLXCEL_BLAS`` asks for and say which one mlx will use.

    *setting* is ``auto`` (default: the system OpenBLAS when present), ``off``
    (mlx's bundled reference BLAS), ``mkl`` (Intel MKL from the ``mkl`` wheel),
    or a path to a BLAS shared library. Returns
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
    if value.lower() == "mkl":
        return _load_mkl()
    path = Path(value).expanduser()
    try:
        library = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        raise BlasError(f"MLXCEL_BLAS={value!r} is not valid: expected auto, off, or the path of a "
                        f"loadable BLAS library ({exc})") from exc
    _kind = "openblas" if "openblas" in path.name.lower() else "custom"
    return f"{path.name} ({path}, {_set_threads(library)})"


def mkl_library() -> Path | None:
    """Where the ``mkl`` wheel put ``libmkl_rt`` in this environment (or the user's), if it is installed."""
    import site

    roots = [Path(sys.prefix), Path(sys.base_prefix), Path(site.getuserbase())]
    for root in dict.fromkeys(roots):
        found = sorted((root / "lib").glob(MKL_PATTERN))
        if found:
            return found[-1]
    return None


def _load_mkl() -> str:
    global _kind
    path = mkl_library()
    if path is None:
        raise BlasError("MLXCEL_BLAS=mkl: Intel MKL is not installed in this environment "
                        "(pip install 'mlxcel[mkl]')")
    threads = _threads()
    # One thread: the sequential layer (no OpenMP runtime spinning beside the event loop).
    os.environ.setdefault("MKL_THREADING_LAYER", "SEQUENTIAL" if threads == 1 else "INTEL")
    try:
        library = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        raise BlasError(f"MLXCEL_BLAS=mkl: {path} cannot be loaded ({exc})") from exc
    _kind = "mkl"
    if os.environ.get("MKL_NUM_THREADS"):
        described = f"{os.environ['MKL_NUM_THREADS']} threads (MKL_NUM_THREADS)"
    else:
        library.MKL_Set_Num_Threads(ctypes.c_int(threads))
        described = f"{threads} thread{'s' if threads > 1 else ''}"
    return f"Intel MKL ({path}, {described}, {os.environ['MKL_THREADING_LAYER'].lower()} layer)"


def _threads() -> int:
    """Usable cores - 1, at least 1 (see :func:`_set_threads`)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


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
    threads = _threads()
    setter(ctypes.c_int(threads))
    return f"{threads} thread{'s' if threads > 1 else ''}"
