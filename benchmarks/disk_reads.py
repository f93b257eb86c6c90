"""What a hit on the prefix cache's disk tier holds the worker for: read in the worker's turn, or read ahead.

An entry of Qwen3.5-0.8B's layer shapes (12 of its layers, a full-attention layer in four, 2 KV heads of 256,
fp32; the MTP head's state beside it; ``benchmarks/disk_writes.py`` builds it) holding --depth tokens is written
to a disk tier, and a restarted tier serves a prompt it is a prefix of. Two sides, taking turns:

- ``in turn``: ``DiskTier.fetch`` alone, as every hit ran before 2026-12-06: the files mapped and summed in the
  worker's turn;
- ``ahead``: ``DiskTier.check_ahead`` first, on the reader thread (what an arrival waits for, while the batch
  steps), then ``fetch``, which maps the files found whole and does not sum them again.

Each side is timed with the file's pages in the page cache (``warm``: the usual case right after a write) and
evicted from it first (``cold``: ``posix_fadvise(DONTNEED)``, as after a restart or memory pressure; what comes
back then is what this machine's disk gives). Prints the seconds ``fetch`` held the worker, each side's median,
and the ratio.

    python -m benchmarks.disk_reads [--depth 32768] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import numpy as np  # noqa: E402
from mlx_lm.models import cache as mlx_cache  # noqa: E402

from benchmarks.disk_writes import _cache  # noqa: E402
from mlxcel.engine.prompt_disk import DiskTier  # noqa: E402


def _evict(directory: Path) -> None:
    """Drop every file of *directory* from the page cache (the kernel may keep what it must)."""
    for path in directory.iterdir():
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _held(side: str, root: Path, layers: list[Any], prompt: np.ndarray, cold: bool) -> float:
    """Seconds ``fetch`` held the calling thread, on a tier opened anew over *root*."""
    classes = {name: c for name, c in vars(mlx_cache).items() if isinstance(c, type)}
    tier = DiskTier(root, 1 << 40, "bench", classes, layers, "head")
    if cold:
        _evict(root)
    if side == "ahead":
        read = tier.check_ahead(prompt, better_than=0)
        assert read is not None and read.result()[0] is not None
    began = time.perf_counter()
    found = tier.fetch(prompt, better_than=0)
    held = time.perf_counter() - began
    assert found is not None
    tier.close()
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    layers, drafter = _cache(args.depth)
    with tempfile.TemporaryDirectory(dir=Path.home()) as scratch:
        root = Path(scratch) / "tier"
        classes = {name: c for name, c in vars(mlx_cache).items() if isinstance(c, type)}
        tier = DiskTier(root, 1 << 40, "bench", classes, layers, "head")
        tier.save(np.arange(args.depth, dtype=np.int64), layers, drafter)
        tier.close()
        size = sum(p.stat().st_size for p in root.iterdir() if p.is_file())
        print(f"an entry: {size / 1e6:.1f} MB at {args.depth} tokens, the head's state with it")
        prompt = np.arange(args.depth + 16, dtype=np.int64)
        for cold in (False, True):
            held: dict[str, list[float]] = {"in turn": [], "ahead": []}
            for _ in range(args.rounds):
                for side in held:
                    held[side].append(_held(side, root, layers, prompt, cold))
            page = "cold" if cold else "warm"
            for side, times in held.items():
                print(f"{page} {side:>8}: held {median(times) * 1000:.0f} ms "
                      f"({', '.join(f'{t * 1000:.0f}' for t in times)}), {median(times) / size * 1e9:.2f} s/GB")
            print(f"{page} in turn / ahead: {median(held['in turn']) / median(held['ahead']):.2f}")


if __name__ == "__main__":
    main()
