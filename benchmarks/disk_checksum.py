"""What the disk tier's checksum costs: CRC-32 of a prompt cache's arrays, beside writing and reading the file.

A cache of --gb gigabytes of bfloat16 KV state (the shape a 28-layer, 8-KV-head model holds), written with
mlx-lm's ``save_prompt_cache`` and read back with ``mx.load``, each timed with and without the checksum in the
same run; prints seconds per GB and the checksum's share of a write and of a read.

    python benchmarks/disk_checksum.py --gb 1
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, save_prompt_cache

from mlxcel.engine.disk_files import checksum


def _cache(gigabytes: float, layers: int = 28) -> list[KVCache]:
    per_layer = gigabytes * 1e9 / layers / 2 / 2  # keys and values, 2 bytes each
    length = int(per_layer / (8 * 128))
    cache = []
    for _ in range(layers):
        layer = KVCache()
        keys = mx.random.normal((1, 8, length, 128)).astype(mx.bfloat16)
        layer.update_and_fetch(keys, keys + 1)
        cache.append(layer)
    mx.eval([layer.state for layer in cache])
    return cache


def _best(run, repeats: int = 3) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0)
    args = parser.parse_args()
    cache = _cache(args.gb)
    arrays = {k: v for k, v in tree_flatten([layer.state for layer in cache]) if isinstance(v, mx.array)}
    size = sum(a.nbytes for a in arrays.values()) / 1e9
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "entry.safetensors"
        write = _best(lambda: save_prompt_cache(str(path), cache, {}))
        read = _best(lambda: mx.eval(list(mx.load(str(path)).values())))
        summed_write = _best(lambda: checksum(arrays))  # the save side: the cache's own (sliced) arrays
        loaded = mx.load(str(path))
        mx.eval(list(loaded.values()))
        summed_read = _best(lambda: checksum(loaded))  # the read side: the arrays just loaded
    print(f"cache {size:.2f} GB: write {write / size:.3f} s/GB, read {read / size:.3f} s/GB")
    print(f"checksum on save {summed_write / size:.3f} s/GB ({summed_write / write:.2f}x of the write), "
          f"on read {summed_read / size:.3f} s/GB ({summed_read / read:.2f}x of the read)")


if __name__ == "__main__":
    main()
