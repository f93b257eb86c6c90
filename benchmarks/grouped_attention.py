"""One query's attention: mlx's CPU kernel against the query heads grouped by KV head, keys summed in blocks.

    python -m benchmarks.grouped_attention [--depths 37 256 1024 8192 32768] [--batch 1] [--repeats 15]

For attention shapes of real and benchmark models (query heads, KV heads, head
size), a decode step's attention (one query per row over *depth* cached keys,
*batch* rows) through ``mx.fast.scaled_dot_product_attention`` as mlx ships it
and through ``mlxcel.models.grouped_attention.grouped``, interleaved in one
process on the same arrays; milliseconds each, the ratio, the largest
difference, and for each side whether the same keys behind 3 or 17 masked
columns of padding (what a continuous batch puts in front of a row) gave other
bytes than the keys alone ("moved"). The fast BLAS (section 9) is loaded first.
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks._common import interleaved_ms
from mlxcel.blas import load_fast_blas

SHAPES = [(16, 4, 64), (8, 2, 128), (16, 2, 128), (32, 8, 128), (64, 32, 16), (16, 16, 64)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--depths", type=int, nargs="+", default=[37, 256, 1024, 8192, 32768])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    print(load_fast_blas())
    import mlx.core as mx

    from mlxcel.models.grouped_attention import grouped

    mlx_attention = mx.fast.scaled_dot_product_attention
    if getattr(mlx_attention, "mlxcel_dispatch", False):  # mlxcel.models.attention's dispatcher is not mlx's
        raise SystemExit("mx.fast.scaled_dot_product_attention is already replaced")
    print(f"{'heads':>5} {'kv':>3} {'dim':>4} {'depth':>6} {'mlx ms':>7} {'grouped ms':>10} {'ratio':>6} "
          f"{'max diff':>9} {'mlx moved':>9} {'grouped moved':>13}")
    for heads, kv_heads, dim in SHAPES:
        for depth in args.depths:
            print(_row(mx, mlx_attention, grouped, heads, kv_heads, dim, depth, args.batch, args.repeats))


def _row(mx: Any, mlx_attention: Any, grouped: Any, heads: int, kv_heads: int, dim: int, depth: int,
         batch: int, repeats: int) -> str:
    q = mx.random.normal((batch, heads, 1, dim), key=mx.random.key(0))
    k = mx.random.normal((batch, kv_heads, depth, dim), key=mx.random.key(1))
    v = mx.random.normal((batch, kv_heads, depth, dim), key=mx.random.key(2))
    mask = mx.ones((batch, 1, 1, depth), mx.bool_)
    mx.eval(q, k, v, mask)
    scale = dim ** -0.5
    sides = {"mlx": lambda: mlx_attention(q, k, v, scale=scale, mask=mask),
             "grouped": lambda: grouped(q, k, v, scale, mask)}
    times = interleaved_ms(sides, repeats)
    ours, theirs = sides["grouped"](), sides["mlx"]()
    mlx_ms, grouped_ms = times["mlx"], times["grouped"]

    def moved(attend: Any) -> str:
        alone = attend(q, k, v, scale, mask)
        for padding in (3, 17):
            stale = mx.random.normal((batch, kv_heads, padding, dim), key=mx.random.key(padding))
            behind = attend(q, mx.concatenate([stale, k], axis=2), mx.concatenate([stale, v], axis=2), scale,
                            mx.concatenate([mx.zeros((batch, 1, 1, padding), mx.bool_), mask], axis=-1))
            if not mx.array_equal(alone, behind).item():
                return "yes"
        return "no"

    return (f"{heads:>5} {kv_heads:>3} {dim:>4} {depth:>6} {mlx_ms:>7.2f} {grouped_ms:>10.2f} "
            f"{mlx_ms / grouped_ms:>6.2f} {mx.abs(ours - theirs).max().item():>9.1e} "
            f"{moved(lambda *a: mlx_attention(*a[:3], scale=a[3], mask=a[4])):>9} {moved(grouped):>13}")

if __name__ == "__main__":
    main()
