"""The heap the server keeps (:mod:`mlxcel.heap`): memory a step frees is there for the next step, no page faults.

Each case runs in a process of its own: glibc's settings bind the whole process, and they are made once, before
anything big is allocated, as ``mlxcel serve`` makes them.
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from mlxcel.heap import HeapError, keep_freed_memory

glibc = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                           reason="the settings are glibc's")

# Page faults of a "step" that makes 64 MiB of arrays after a step that made and freed the same (mlx's CPU backend
# takes every buffer from malloc).
SECOND_STEP_FAULTS = """
import resource, sys
from mlxcel.heap import keep_freed_memory
print(keep_freed_memory(sys.argv[1]), file=sys.stderr)
import mlx.core as mx
step = mx.ones((16 << 20,)) * 2
mx.eval(step)
del step
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
step = mx.ones((16 << 20,)) * 2
mx.eval(step)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def second_step_faults(setting: str) -> int:
    result = subprocess.run([sys.executable, "-c", SECOND_STEP_FAULTS, setting], capture_output=True, text=True,
                            check=True)
    return int(result.stdout)


@glibc
def test_a_step_reuses_the_memory_the_step_before_it_freed() -> None:
    pages = (64 << 20) // 4096
    assert second_step_faults("system") >= pages // 2  # glibc unmapped the block: every page faults again
    assert second_step_faults("keep") < pages // 100


def test_system_leaves_the_c_librarys_defaults_and_a_bad_value_is_refused() -> None:
    assert keep_freed_memory("system") == "the C library's defaults (MLXCEL_HEAP=system)"
    with pytest.raises(HeapError, match="MLXCEL_HEAP='plenty' is not valid: expected keep"):
        keep_freed_memory("plenty")
