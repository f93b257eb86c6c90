"""Keep the memory a step frees for the steps after it, on Linux (glibc).

mlx's CPU backend takes every array's buffer from ``malloc`` and frees it once the step that made it is done.
glibc hands big blocks back to the kernel (a block over its mmap threshold is unmapped when freed, the heap's free
top is trimmed), so a step that needs more than the steps before it got its buffers as fresh pages, a page fault
for every 4 KiB: a 16-row verify of three drafts took 1.62 s after steps of two drafts and 1.17 s after its own
kind, and the rule that picks the drafts from measured costs learnt the dearer figure and kept the batch on two
(docs/benchmarks.md, 2026-12-05, seventh). One arena, no mmap and no trimming keep what a step freed in the process
for the next step to reuse: the process holds its peak (which it reaches again at the next such step anyway).

``MLXCEL_HEAP=system`` leaves glibc's defaults. Elsewhere (macOS's allocator, musl) nothing is changed: mlx's
Metal backend keeps a buffer cache of its own.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

logger = logging.getLogger(__name__)

# glibc's <malloc.h>: mallopt's parameters.
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
M_ARENA_MAX = -8
#: The largest trim threshold mallopt takes (an int): the heap's top is given back only past 2 GiB free.
NEVER_TRIM = 2**31 - 1


class HeapError(ValueError):
    """``MLXCEL_HEAP`` holds something other than ``keep`` or ``system``."""


def keep_freed_memory(setting: str | None = None) -> str:
    """Set glibc's allocator to keep freed memory for reuse, unless *setting* (default: ``MLXCEL_HEAP``) is
    ``system``; what the process's heap does, for the start-up log. Call it before the model loads (the arena
    limit binds the threads started after it)."""
    value = (setting if setting is not None else os.environ.get("MLXCEL_HEAP", "")).strip() or "keep"
    if value not in ("keep", "system"):
        raise HeapError(f"MLXCEL_HEAP={value!r} is not valid: expected keep (the default) or system")
    if value == "system":
        return "the C library's defaults (MLXCEL_HEAP=system)"
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return "the C library's defaults (not glibc)"
    libc = ctypes.CDLL(None)
    if not all(libc.mallopt(parameter, value) for parameter, value in
               ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, NEVER_TRIM))):
        logger.warning("glibc refused a malloc setting: freed memory may go back to the kernel between steps")
        return "glibc's defaults (a mallopt call failed)"
    return "glibc, freed memory kept for reuse (one arena, no mmap, no trim)"
