"""``--kv-bits``: memory per 1k tokens of context, what quantizing the KV cache does to the logits, and decode speed.

    python -m benchmarks.kv_bits [--families llama qwen3_5] [--hidden 1024] [--layers 12] [--depth 4096]

For each model (the long-context benchmark's: fp32, random weights) and each
precision (full, 8 bits, 4 bits), in one process: the prompt (--depth tokens of
words) prefilled through mlxcel's cache maker (``engine.loading.cache_maker``,
what ``--kv-bits`` serves with), then --steps tokens teacher-forced one at a
time, the same tokens for every precision. Prints the cache's bytes per 1k
tokens, the largest logit difference from full precision (relative to the
logits' spread), how often the most likely token is the same, and the median
decode step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

from benchmarks._common import context_model, context_window, words  # noqa: E402


def main() -> None:
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load

    from mlxcel.engine.loading import cache_maker

    parser = argparse.ArgumentParser()
    parser.add_argument("--families", nargs="+", default=["llama", "qwen3_5"])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--depth", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    context = context_window(args.depth + args.steps)
    print("family   bits | cache MB per 1k tokens | max |logit diff| / spread | same top-1 | step ms")
    for family in args.families:
        checkpoint = context_model(family, args.hidden, args.layers, context)
        model, tokenizer = load(str(checkpoint))
        rng = random.Random(0)
        ids = tokenizer.encode(words(tokenizer, args.depth + args.steps, rng), add_special_tokens=False)
        prompt, forced = ids[:args.depth], ids[args.depth:args.depth + args.steps]
        reference: list[np.ndarray] = []
        for bits in (None, 8, 4):
            cache = cache_maker(model, bits)()
            for start in range(0, len(prompt), 512):
                model(mx.array([prompt[start:start + 512]]), cache=cache)
                mx.eval([c.state for c in cache])
            held = sum(c.nbytes for c in cache)
            rows, steps = [], []
            for token in forced:
                start = time.perf_counter()
                logits = model(mx.array([[token]]), cache=cache)[0, -1]
                mx.eval(logits)
                steps.append(time.perf_counter() - start)
                rows.append(np.array(logits))
            if bits is None:
                reference = rows
            spread = max(float(r.max() - r.min()) for r in reference)
            diff = max(float(np.abs(r - f).max()) for r, f in zip(rows, reference, strict=True))
            same = sum(int(r.argmax() == f.argmax()) for r, f in zip(rows, reference, strict=True)) / len(rows)
            print(f"{family:8s} {bits or 'full':>4} | {held / len(prompt) * 1000 / 2**20:22.2f} | "
                  f"{diff / spread:25.4f} | {same:10.0%} | {statistics.median(steps) * 1000:7.1f}", flush=True)


if __name__ == "__main__":
    main()
