"""Which products make a K-wide verify inexact: per shape, whether row 0 of an M-row product has M=1's bytes.

    [MLXCEL_BLAS=...] python -m benchmarks.verify_rows [--hidden 1024]

The exactness probe (engine/exactness.py) vetoes a verify when its logits differ from the single-token
chain's; this says where that comes from on the BLAS in use. For each weight shape (outputs x inputs)
a verify meets at *--hidden* (every projection of benchmarks/_common.mtp_model's Qwen 3.5 at that
width, and a few larger ones), and for the attention of 1 vs M new queries over a cache (mlx's
``scaled_dot_product_attention``, causal, 12 and 1024 cached keys), it prints the row counts M = 2..4
at which the first row is byte-identical to the one-row product. A shape missing M = 2 makes every K
inexact; one missing only M = 4, K = 4's wide verify.
"""

from __future__ import annotations

import argparse

from mlxcel.blas import load_fast_blas

BLAS = load_fast_blas()

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402


def same(a: mx.array, b: mx.array) -> bool:
    return bool(np.array_equal(np.array(a), np.array(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    h = parser.parse_args().hidden
    print(f"BLAS: {BLAS}")
    mx.random.seed(0)
    # q (with its gate) / k, v / o of 16-wide heads; MLP up / down; the gated-delta mixer's in and out
    # projections; the LM head (vocab 512); then shapes of real models.
    shapes = [(2 * h, h), (h // 2, h), (h, h), (2 * h, h), (h, 2 * h), (128, h), (64, h), (4, h), (h, 64), (512, h),
              (4096, 4096), (32768, 1024), (1024, 4096)]
    for rows, columns in dict.fromkeys(shapes):
        w, x = mx.random.normal((rows, columns)) * 0.02, mx.random.normal((4, columns))
        one = (x[:1] @ w.T)[0]
        equal = [m for m in range(2, 5) if same((x[:m] @ w.T)[0], one)]
        print(f"x @ W.T, W {rows}x{columns}: row 0 as M=1's at M = {equal or 'none'}")
    heads, kv_heads = max(1, h // 16), max(1, h // 32)
    for cached in (12, 1024):
        q = mx.random.normal((1, heads, 4, 16))
        k, v = (mx.random.normal((1, kv_heads, cached + 4, 16)) for _ in range(2))
        one = mx.fast.scaled_dot_product_attention(q[:, :, :1], k[:, :, :cached + 1], v[:, :, :cached + 1],
                                                   scale=0.25)
        equal = [m for m in range(2, 5) if same(mx.fast.scaled_dot_product_attention(
            q[:, :, :m], k[:, :, :cached + m], v[:, :, :cached + m], scale=0.25, mask="causal")[:, :, :1], one)]
        print(f"attention, {heads} heads over {cached} cached keys: query 0 as a lone query's at M = "
              f"{equal or 'none'}")


if __name__ == "__main__":
    main()
