"""Float weights stored (out, in), as loaded, against stored (in, out) (``mlxcel.models.turned_weights``),
side by side: each linear layer's products, and mlx-lm's own decode of the whole model.

    python -m benchmarks.turned_weights [--rows 1 4 12 24 48] [--rounds 3] [--tokens 24]

The ``--released`` pairing's target (``benchmarks/batch_mtp.py``: Qwen3.5-0.8B's layer shapes, 12 layers,
~1 GB fp32) is loaded twice and one copy turned. First every float linear layer's product of *rows* rows, best
of 7 (plain mlx products, no row split: the layout alone), then *rounds* of mlx-lm's ``stream_generate``
(*tokens* tokens, greedy) on each copy in turn; prints milliseconds and tokens/s and the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from benchmarks._common import mtp_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 12, 24, 48])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args()

    from mlx_lm import load, stream_generate

    from mlxcel.models.turned_weights import turn

    path = mtp_model("aligned", 0.001, 12, 1024, 4096, True)
    stored, tokenizer = load(str(path))
    turned, _ = load(str(path))
    print(f"model: {path.name}; {turn(turned)} weight(s) turned")

    def layers(model: Any) -> list[Any]:
        return [m for _, m in model.named_modules() if isinstance(m, nn.Linear) and m.weight.dtype == mx.float32]

    def best(model: Any, rows: int) -> float:
        blocks = {width: mx.random.normal((rows, width), key=mx.random.key(rows))
                  for width in {m.weight.shape[1] for m in layers(model)}}
        mx.eval(list(blocks.values()))
        times = []
        for _ in range(7):
            started = time.perf_counter()
            mx.eval([layer(blocks[layer.weight.shape[1]]) for layer in layers(model)])
            times.append(time.perf_counter() - started)
        return min(times) * 1000

    print(f"{'rows':>5} {'(out, in) ms':>13} {'(in, out) ms':>13} {'ratio':>6}")
    for rows in args.rows:
        before, after = best(stored, rows), best(turned, rows)
        print(f"{rows:>5} {before:13.1f} {after:13.1f} {before / after:6.2f}")

    def rate(model: Any) -> float:
        started, count = 0.0, 0
        for count, _ in enumerate(stream_generate(model, tokenizer, "hello world " * 4, max_tokens=args.tokens)):
            if count == 0:
                started = time.perf_counter()  # from the first token: decode, not the prompt
        return count / (time.perf_counter() - started)

    rates: dict[str, list[float]] = {"(out, in)": [], "(in, out)": []}
    for _ in range(args.rounds):
        rates["(out, in)"].append(rate(stored))
        rates["(in, out)"].append(rate(turned))
    for side, values in rates.items():
        print(f"decode {side}: " + " ".join(f"{value:.2f}" for value in values) + " tokens/s")
    ratios = [after / before for before, after in zip(rates["(out, in)"], rates["(in, out)"], strict=True)]
    print(f"decode (in, out) / (out, in), by round: {' '.join(f'{r:.2f}' for r in ratios)}; "
          f"median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
