"""Which row counts of a product give a row the same bytes, and what padding or chunking costs.

    python -m benchmarks.kernel_classes [--shapes 512x1024 128x1024 64x1024 2048x1024 512x64] [--rows 48]

For each (out, in) weight shape, fp32, ``x @ W.T`` for every count n of 1..ROWS rows of one random block:
the counts are grouped into classes whose products give every row they share the same bytes (printed as a
string of class digits, n = 1 first). On this machine's OpenBLAS a shape has at most two classes, the small
products and the large (for 1024-wide inputs the switch is where n x out x in reaches 2^20), which is what lets
:mod:`mlxcel.models.row_exact` top a small product up past the switch instead of multiplying a row at a
time. Then microseconds, 26 weights of the shape in turn (so they are read from memory, as a model's
layers are): 1 row alone; 1 row topped up to the switch; 8 and 32 rows as one product and a row at a time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

from mlxcel.blas import load_fast_blas

print(load_fast_blas())


def _classes(out: int, inp: int, rows: int) -> tuple[str, int | None]:
    import mlx.core as mx
    import numpy as np

    w, x = mx.random.normal((out, inp), key=mx.random.key(0)), mx.random.normal((rows, inp), key=mx.random.key(1))
    products = {n: np.array(x[:n] @ w.T) for n in range(1, rows + 1)}
    firsts: list[int] = []  # each class's smallest count
    digits = []
    for n, product in products.items():
        same = next((i for i, m in enumerate(firsts) if np.array_equal(product[:min(n, m)], products[m][:min(n, m)])),
                    None)
        if same is None:
            firsts.append(n)
            same = len(firsts) - 1
        digits.append(str(same) if same < 10 else "+")
    return "".join(digits), (firsts[1] if len(firsts) == 2 else None)


def _us(call: Callable[[], Any], repeats: int = 7, calls: int = 50) -> float:
    import mlx.core as mx

    mx.eval(call())
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            mx.eval(call())
        runs.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="+", default=["512x1024", "128x1024", "64x1024", "2048x1024", "512x64"])
    parser.add_argument("--rows", type=int, default=48)
    args = parser.parse_args()
    print(f"{'shape':>10} {'switch':>6}  classes (n = 1..{args.rows})")
    timed = []
    for text in args.shapes:
        out, inp = (int(v) for v in text.split("x"))
        classes, switch = _classes(out, inp, args.rows)
        print(f"{text:>10} {switch or '-':>6}  {classes}")
        if switch is not None:
            timed.append((text, out, inp, switch))
    print(f"\n{'shape':>10} {'1 row':>8} {'1 padded':>8} {'8 whole':>8} {'8 apart':>8} {'32 whole':>8} "
          f"{'32 apart':>8}  (us)")
    for text, out, inp, switch in timed:
        print(f"{text:>10} " + " ".join(f"{cost:>8.0f}" for cost in _costs(out, inp, switch)))


def _costs(out: int, inp: int, switch: int) -> list[float]:
    """Microseconds of: 1 row; 1 row topped up to *switch*; 8 and 32 rows whole and a row at a time."""
    import mlx.core as mx

    weights = [mx.random.normal((out, inp)) for _ in range(26)]
    x = mx.random.normal((32, inp))
    pad = mx.zeros((max(0, switch - 1), inp))
    mx.eval(weights, x, pad)
    turn = iter(range(1 << 62))

    def w() -> Any:
        return weights[next(turn) % len(weights)]

    return [_us(lambda: x[:1] @ w().T), _us(lambda: (mx.concatenate([x[:1], pad]) @ w().T)[:1]),
            _us(lambda: x[:8] @ w().T), _us(lambda: mx.concatenate([x[i:i + 1] @ w().T for i in range(8)])),
            _us(lambda: x @ w().T, calls=20),
            _us(lambda: mx.concatenate([x[i:i + 1] @ w().T for i in range(32)]), calls=10)]

if __name__ == "__main__":
    main()
