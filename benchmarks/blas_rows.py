"""What an M-row fp32 matmul costs and whether its rows are a 1-row matmul's, per BLAS.

    python -m benchmarks.blas_rows [--blas openblas mkl off] [--rows 1 2 3 4 8]

A B=1 decode step multiplies one row by every weight matrix; an MTP verify of
width K multiplies K rows. Both read all the weights, so on a bandwidth-bound
machine the verify should cost about one step, and it is exact only if each of
its rows comes out bit for bit as a 1-row product would (the exactness probe's
question, asked here of the bare matmul). For each BLAS (a child process each:
mlx resolves its BLAS once) and each M: the best time over 0.5 GiB of weights
shaped as a hidden-1024 llama's (``x @ W.T``), the read rate it implies, its
cost relative to M = 1, and which weight shapes give rows identical to M = 1.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

#: (out, in) of a hidden-1024 llama layer's matmuls: q/o, k/v, gate/up, down.
SHAPES = [(1024, 1024), (256, 1024), (3072, 1024), (1024, 3072)]


def measure(rows: list[int]) -> dict[str, object]:
    from mlxcel.blas import load_fast_blas

    described = load_fast_blas()  # before mlx loads, or mlx keeps its bundled BLAS

    import mlx.core as mx

    mx.random.seed(0)
    layer_bytes = 4 * sum(o * i for o, i in SHAPES)
    weights = [mx.random.normal(shape) for _ in range(max(1, (1 << 29) // layer_bytes)) for shape in SHAPES]
    mx.eval(weights)
    total = sum(w.nbytes for w in weights)
    inputs = {i: mx.random.normal((max(rows), i)) for i in {i for _, i in SHAPES}}
    result: dict[str, object] = {"blas": described, "bytes": total, "rows": {}}
    for m in rows:
        def run(m: int = m) -> None:
            mx.eval([inputs[w.shape[1]][:m] @ w.T for w in weights])
        run()
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
        exact = []
        for shape in SHAPES:
            w = weights[SHAPES.index(shape)]
            x = inputs[shape[1]][:m]
            whole = x @ w.T
            ones = mx.concatenate([x[r:r + 1] @ w.T for r in range(m)])
            if bool(mx.array_equal(whole, ones).item()):
                exact.append(f"{shape[0]}x{shape[1]}")
        result["rows"][m] = {"seconds": best, "exact": exact}  # type: ignore[index]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blas", nargs="+", default=["openblas", "mkl"], help="MLXCEL_BLAS values")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.rows)))
        return
    print(f"{'BLAS':<9} {'M':>2} {'ms / 0.5 GiB':>12} {'GB/s':>6} {'x M=1':>6}  rows bit-identical to M=1 for")
    for blas in args.blas:
        env = {**os.environ, "MLXCEL_BLAS": "auto" if blas == "openblas" else blas}
        child = subprocess.run([sys.executable, "-m", "benchmarks.blas_rows", "--child", "--rows",
                                *map(str, args.rows)], env=env, capture_output=True, text=True)
        if child.returncode != 0:
            print(f"{blas}: failed\n{child.stderr[-2000:]}")
            continue
        result = json.loads(child.stdout.strip().splitlines()[-1])
        print(f"# {blas}: {result['blas']}")
        base = result["rows"][str(args.rows[0])]["seconds"]
        for m, row in result["rows"].items():
            exact = ", ".join(row["exact"]) if len(row["exact"]) < len(SHAPES) else "all shapes"
            print(f"{blas:<9} {m:>2} {row['seconds'] * 1000:>12.1f} {result['bytes'] / row['seconds'] / 1e9:>6.1f} "
                  f"{row['seconds'] / base:>6.2f}  {exact or 'none'}")


if __name__ == "__main__":
    main()
