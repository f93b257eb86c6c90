"""What an entry written to the prefix cache's disk tier costs the batch: in the worker's turn, or by the writer.

A decode loop (each step an MLX forward of about --step-ms on this machine: matrix products of one layer's MLP
size, Qwen3.5-0.8B's) that evicts one prompt's cache to the disk tier at each of --saves steps, as the rows of a
round that finish one after another do when memory is full. Each cache has Qwen3.5-0.8B's layer shapes (12 layers:
a full-attention layer in four, 2 KV heads of 256; gated-delta state of 16 heads of 128), --depth tokens, and the
MTP head's KV beside it. Two sides, taking turns, each in a fresh directory:

- ``in turn``: the write as the disk tier made it before 2026-12-06, in the worker's turn: the checksum, then
  mlx-lm's ``save_prompt_cache``, then the drafter's state by ``mx.save_safetensors``;
- ``writer``: ``DiskTier.save``, which makes the arrays ready and hands them to its writer thread.

Prints the loop's seconds (steps and saves, until every file is on disk), the seconds a save held the loop, and
the ratio.

    python -m benchmarks.disk_writes [--depth 2048] [--saves 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from mlx_lm.models import cache as mlx_cache  # noqa: E402

from mlxcel.engine import drafter_disk  # noqa: E402
from mlxcel.engine.disk_files import checksum  # noqa: E402
from mlxcel.engine.prompt_disk import FORMAT, DiskTier, _name  # noqa: E402


def _cache(depth: int) -> tuple[list[Any], tuple[int, Any]]:
    """A prompt cache of Qwen3.5-0.8B's layer shapes (12 of its layers) holding *depth* tokens, and its MTP
    head's (token, state) as the own-cache head keeps it."""
    def attention() -> Any:
        layer = mlx_cache.KVCache()
        layer.update_and_fetch(mx.random.normal((1, 2, depth, 256)), mx.random.normal((1, 2, depth, 256)))
        return layer

    def gated_delta() -> Any:
        layer = mlx_cache.ArraysCache(2)
        layer[0], layer[1] = mx.random.normal((1, 3, 6144)), mx.random.normal((1, 16, 128, 128))
        return layer

    layers = [attention() if i % 4 == 3 else gated_delta() for i in range(12)]
    head = ([attention()], mx.random.normal((1, 1, 1024)), 3)
    mx.eval([layer.state for layer in layers], head[0][0].state, head[1])
    return layers, (7, head)


def _in_turn(directory: Path, tokens: np.ndarray, cache: list[Any], drafter: tuple[int, Any]) -> None:
    """The write as the disk tier made it before 2026-12-06 (all of it in the worker's turn)."""
    flat = tree_flatten([layer.state for layer in cache])
    path = directory / _name(tokens)
    mlx_cache.save_prompt_cache(str(path), cache, {
        "mlxcel_format": FORMAT, "mlxcel_model": "bench", "mlxcel_rewinds": "0",
        "mlxcel_tokens": json.dumps(tokens.tolist(), separators=(",", ":")),
        "mlxcel_checksum": checksum({key: value for key, value in flat if isinstance(value, mx.array)})})
    arrays: dict[str, Any] = {}
    shape = drafter_disk._encode(drafter[1], arrays)
    mx.save_safetensors(str(path.with_name(path.stem + drafter_disk.SUFFIX)), arrays, {
        "mlxcel_drafter_format": drafter_disk.FORMAT, "mlxcel_drafter": "head", "mlxcel_token": str(drafter[0]),
        "mlxcel_shape": json.dumps(shape), "mlxcel_checksum": checksum(arrays)})


def _loop(side: str, caches: list[tuple[list[Any], tuple[int, Any]]], depth: int, weights: tuple[Any, Any],
          steps_per_save: int) -> tuple[float, list[float]]:
    """The loop's seconds until every file is on disk, and the seconds each save held it."""
    up, down = weights
    x = mx.random.normal((16, 1024))
    held: list[float] = []
    with tempfile.TemporaryDirectory() as root:
        classes = {name: c for name, c in vars(mlx_cache).items() if isinstance(c, type)}
        tier = DiskTier(Path(root) / "tier", 1 << 40, "bench", classes, caches[0][0], "head")
        started = time.perf_counter()
        for i, (cache, drafter) in enumerate(caches):
            for _ in range(steps_per_save):
                x = mx.tanh((x @ up) @ down)
                mx.eval(x)
            tokens = np.arange(i, i + depth, dtype=np.int64)
            began = time.perf_counter()
            if side == "writer":
                tier.save(tokens, cache, drafter)
            else:
                _in_turn(tier.directory, tokens, cache, drafter)
            held.append(time.perf_counter() - began)
        tier.close()  # waits for the writer
        return time.perf_counter() - started, held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=2048)
    parser.add_argument("--saves", type=int, default=16)
    parser.add_argument("--steps-per-save", type=int, default=1)
    parser.add_argument("--step-ms", type=float, default=450, help="one step's forward (a 16-row step at 2k: 0.45 s)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    caches = [_cache(args.depth) for _ in range(args.saves)]
    cache, (_, head) = caches[0]
    size = sum(a.nbytes for _, a in tree_flatten([[layer.state for layer in cache], head]) if isinstance(a, mx.array))
    up, down = mx.random.normal((1024, 3584)) / 32, mx.random.normal((3584, 1024)) / 60
    mx.eval(up, down)
    x, times = mx.random.normal((16, 1024)), []
    for _ in range(20):
        began = time.perf_counter()
        mx.eval(mx.tanh((x @ up) @ down))
        times.append(time.perf_counter() - began)
    one = min(times)
    repeat = max(1, round(args.step_ms / 1000 / one))  # products a step, for about --step-ms
    print(f"an entry: {size / 1e6:.1f} MB at {args.depth} tokens, the head's state with it; "
          f"{args.saves} saves, a step of {repeat} products ({repeat * one * 1000:.0f} ms) before each")
    results: dict[str, list[float]] = {"in turn": [], "writer": []}
    holds: dict[str, list[float]] = {"in turn": [], "writer": []}
    for _ in range(args.rounds):
        for side in results:
            seconds, held = _loop(side, caches, args.depth, (up, down), repeat * args.steps_per_save)
            results[side].append(seconds)
            holds[side].extend(held)
    for side in results:
        print(f"{side:>8}: loop {median(results[side]):.2f} s (rounds {', '.join(f'{s:.2f}' for s in results[side])}),"
              f" a save held it {median(holds[side]) * 1000:.1f} ms (median; max {max(holds[side]) * 1000:.1f})")
    print(f"in turn / writer: {median(results['in turn']) / median(results['writer']):.3f}")


if __name__ == "__main__":
    main()
