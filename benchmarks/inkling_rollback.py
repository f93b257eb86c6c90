"""Inkling's rollback across the convolution states: slicing the verify's inputs vs snapshot and replay.

    python -m benchmarks.inkling_rollback [--hidden 768 --layers 12 --k 2 3 4 --repeats 20]

A rejected round must leave every layer's four convolution states as single steps would. Two ways:

- *slice* (mlxcel's ``InklingTarget``): the verify keeps each convolution's whole input (its state,
  then the block), and a rollback trims the keys/values and takes the state as the slice of that
  input ending at the last kept token: no recomputation;
- *replay* (upstream's Inkling TR): keep the caches as they were before the verify (keys/values
  offset, convolution states), run a plain verify, and on a rejection put them back and run the
  ``kept`` tokens through the model again (one forward of ``kept`` tokens: the cheapest replay).

For each K and each number of kept tokens of a rejected round (1 to K-1) this prints the median
round (verify + rollback, evaluated) both ways and their ratio, and what keeping the inputs costs a
round that rejects nothing (slice's verify vs a plain one). The model is a random fp32 Inkling of
realistic size (benchmarks/inkling_decode.py's: all-dense MLPs three times the width, 64-wide
heads, window 512, relative extent 1024) after a 300-token prompt, under this process's BLAS.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from mlxcel.blas import load_fast_blas

BLAS = load_fast_blas()

import mlx.core as mx  # noqa: E402

from benchmarks._common import median  # noqa: E402
from benchmarks.inkling_decode import inkling_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--k", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    from mlxcel.checkpoints import inspect_checkpoint, load_checkpoint
    from mlxcel.families.inkling.target import InklingTarget

    directory = inkling_model(args.hidden, args.layers)
    model, _ = load_checkpoint(inspect_checkpoint(directory))
    target = InklingTarget(model)
    cache = model.make_cache()
    target.forward(mx.array([[3 + i % 400 for i in range(300)]]), cache)
    mx.eval([c.state for c in cache])
    base = [(c.offset, dict(c.conv)) for c in cache]

    def reset() -> None:
        for c, (offset, conv) in zip(cache, base, strict=True):
            c.kv.trim(c.offset - offset)
            c.conv = dict(conv)

    def timed(run: Any, block: mx.array, kept: int) -> float:
        reset()
        started = time.perf_counter()
        run(block, kept)
        mx.eval([a for c in cache for a in c.live_state()])
        return time.perf_counter() - started

    def sliced(block: mx.array, kept: int) -> None:
        verify = target.verify(block, cache, "wide")
        mx.eval(verify.logits)
        target.rollback(cache, verify, kept)

    def replayed(block: mx.array, kept: int) -> None:
        saved = [(c.offset, dict(c.conv)) for c in cache]
        mx.eval(target.forward(block, cache)[0])
        if kept < block.shape[1]:
            for c, (offset, conv) in zip(cache, saved, strict=True):
                c.kv.trim(c.offset - offset)
                c.conv = conv
            target.forward(block[:, :kept], cache)

    size = sum(f.stat().st_size for f in directory.glob("*.safetensors")) / 1e6
    print(f"BLAS: {BLAS}; model: {directory.name} ({size:.0f} MB fp32), offset 300, median of {args.repeats}")
    print(f"{'K':>2} {'kept':>4} {'slice ms':>8} {'replay ms':>9} {'replay/slice':>12}")
    for k in args.k:
        block = mx.array([[11 + i for i in range(k)]])
        for kept in range(1, k + 1):
            slice_ms, replay_ms = [], []
            for _ in range(args.repeats):  # alternating, so a slow spell hits both
                slice_ms.append(timed(sliced, block, kept) * 1000)
                replay_ms.append(timed(replayed, block, kept) * 1000)
            s, r = median(slice_ms), median(replay_ms)
            note = "" if kept < k else "  (nothing rejected: no rollback; slice keeps the inputs anyway)"
            print(f"{k:>2} {kept:>4} {s:>8.2f} {r:>9.2f} {r / s:>12.2f}{note}")
    reset()


if __name__ == "__main__":
    main()
