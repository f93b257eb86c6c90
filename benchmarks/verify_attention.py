"""Can a verify's K queries read the KV cache once and still give each classic step's bytes? (CPU)

    python -m benchmarks.verify_attention [--depths 1024 4097 8192] [--k 3] [--shapes 16,4,64 8,2,128]

A classic step attends one query over its prefix; the exact (``rows``) verify
attends each of its K queries the same way, one call per query, so a round
reads the cache K times. Three ways to read it once, each checked for bytes
against the step at the same position (random arrays, 20 positions per depth),
and timed against the two one-query forms (mlx's kernel, and mlxcel's grouped):

- ``one product``: the K queries' rows (x the query heads of a KV head) in one
  product over the cache up to a multiple of 256 positions (the cut the step
  at each position makes too), each query's own rest of its keys alone, the
  two merged by log-sum-exp;
- ``padded``: the same, with every product, the step's too, padded to the rows
  of 4 queries, so that a query's rows never see another kernel: the step then
  computes 4 queries' worth;
- mlx's own causal attention of the K queries (inexact by construction: its
  later queries sum over masked keys), for its cost.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks._common import interleaved_ms
from mlxcel.blas import load_fast_blas

SLOTS = 4
BLOCK = 256


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--depths", type=int, nargs="+", default=[1024, 4097, 8192])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--shapes", nargs="+", default=["16,4,64", "8,2,128", "64,32,16"])
    args = parser.parse_args()
    print(load_fast_blas())
    import mlx.core as mx

    from mlxcel.models.grouped_attention import grouped

    mlx_attention = mx.fast.scaled_dot_product_attention
    print(f"{'shape':>10} {'depth':>6} | exact of 20: {'one product':>11} {'padded':>6} | ms: {'mlx step':>8} "
          f"{'grouped step':>12} {'padded step':>11} | K={args.k} verify: {'rows (grouped)':>14} "
          f"{'padded':>6} {'mlx causal':>10}")
    for shape in args.shapes:
        heads, kv_heads, dim = (int(x) for x in shape.split(","))
        for depth in args.depths:
            print(_row(mx, mlx_attention, grouped, (heads, kv_heads, dim), depth, args.k))


def _row(mx: Any, mlx_attention: Any, grouped: Any, shape: tuple[int, int, int], depth: int, k_block: int) -> str:
    heads, kv_heads, dim = shape
    arrays = [mx.random.normal((1, h, depth + k_block, dim), key=mx.random.key(i))
              for i, h in enumerate((heads, kv_heads, kv_heads))]
    mx.eval(*arrays)
    q, k, v = arrays
    scale = dim ** -0.5
    exact = [0, 0]
    for offset in range(depth - 20, depth):
        first = offset - k_block + 1
        block = q[:, :, first:offset + 1]
        for slot, rows_of in enumerate((k_block, SLOTS)):
            steps = [_split(mx, block[:, :, i:i + 1], k, v, first + i, scale, 1 if rows_of == k_block else SLOTS)
                     for i in range(k_block)]
            exact[slot] += bool(mx.array_equal(_split(mx, block, k, v, first, scale, rows_of),
                                               mx.concatenate(steps, axis=2)).item())
    end = depth + k_block
    one, many = q[:, :, end - 1:end], q[:, :, depth:end]
    times = interleaved_ms({
        "mlx step": lambda: mlx_attention(one, k, v, scale=scale),
        "grouped step": lambda: grouped(one, k, v, scale),
        "padded step": lambda: _split(mx, one, k, v, end - 1, scale, SLOTS),
        "rows": lambda: [grouped(many[:, :, i:i + 1], k[:, :, :depth + i + 1], v[:, :, :depth + i + 1], scale)
                         for i in range(k_block)],
        "padded verify": lambda: _split(mx, many, k, v, depth, scale, SLOTS),
        "mlx causal": lambda: mlx_attention(many, k, v, scale=scale, mask="causal"),
    }, repeats=9)
    name = ",".join(map(str, shape))
    return (f"{name:>10} {depth:>6} | {'':>12} {exact[0]:>11} {exact[1]:>6} | {times['mlx step']:>12.2f} "
            f"{times['grouped step']:>12.2f} {times['padded step']:>11.2f} | {'':>11} {times['rows']:>14.2f} "
            f"{times['padded verify']:>6.2f} {times['mlx causal']:>10.2f}")

def _split(mx: Any, q: Any, k: Any, v: Any, first: int, scale: float, rows_of: int) -> Any:
    """Queries at positions first.. over their prefixes, the prefix cut at a multiple of :data:`BLOCK` (the
    same cut for a query in a verify and for the step at its position): the keys before the cut in one
    product of *rows_of* queries' rows (zero-padded; the queries sharing a cut), each query's own tail
    alone, merged by log-sum-exp."""
    batch, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    rep = heads // kv_heads
    grouped_q = (q * scale).reshape(batch, kv_heads, rep, length, dim).swapaxes(2, 3)  # (B, KV, L, rep, D)
    outs = []
    i = 0
    while i < length:
        cut = (first + i) // BLOCK * BLOCK
        j = i
        while j < length and (first + j) // BLOCK * BLOCK == cut:
            j += 1
        rows = grouped_q[:, :, i:j]
        width = max(rows_of, j - i)
        if width > j - i:
            rows = mx.concatenate([rows, mx.zeros((batch, kv_heads, width - (j - i), rep, dim))], axis=2)
        shared = _partial(mx, rows.reshape(batch, kv_heads, width * rep, dim), k[:, :, :cut], v[:, :, :cut]) \
            if cut else None
        for n in range(i, j):
            end = first + n + 1
            tail = _partial(mx, grouped_q[:, :, n], k[:, :, cut:end], v[:, :, cut:end])
            if shared is None:
                outs.append(tail[0] / tail[2])
            else:
                outs.append(_merge(mx, tuple(x[:, :, (n - i) * rep:(n - i + 1) * rep] for x in shared), tail))
        i = j
    return mx.stack(outs, axis=3).reshape(batch, heads, length, dim)


def _partial(mx: Any, rows: Any, k: Any, v: Any) -> tuple[Any, Any, Any]:
    scores = rows @ k.swapaxes(-1, -2)
    top = scores.max(axis=-1, keepdims=True)
    weights = mx.exp(scores - top)
    return weights @ v, top, weights.sum(axis=-1, keepdims=True)


def _merge(mx: Any, a: tuple[Any, Any, Any], b: tuple[Any, Any, Any]) -> Any:
    top = mx.maximum(a[1], b[1])
    wa, wb = mx.exp(a[1] - top), mx.exp(b[1] - top)
    return (a[0] * wa + b[0] * wb) / (a[2] * wa + b[2] * wb)


if __name__ == "__main__":
    main()
