"""A step's products laid in tiles against cut into one kernel's run, side by side: what each costs a step.

    python -m benchmarks.row_tiles [--widths 1 2 4 8 16] [--positions 1 4] [--repeats 7] [--swapped]

``mlxcel.models.row_exact.measure`` gives every row its own bytes at any width one of two ways (see its
docstring): products kept within the run of row counts that share a kernel, cut into pieces of it (``run``),
or rows laid a few to a tile of rows that one kernel multiplies alike (``tiles``). On OpenBLAS on a Zen 3
the run a lone row is in ends at 3 rows and the tiles hold 6 rows of 12. Here the ``--released`` pairing's
target layers (``benchmarks/batch_mtp.py``: Qwen3.5-0.8B's shapes, 12 layers, ~1 GB fp32) multiply a block
of *width* rows x *positions* positions (a batch's step at 1, a verify's block at K + 1) through every float
linear layer, both ways, on the MLX thread (the shapes measure() leaves out of tiles, weights under a million
elements, as it measured them on both sides); prints the best of *repeats* milliseconds and the ratio. Where
this BLAS has no tiles, its first line says so, and both sides are the same.

``--swapped`` adds a third layout, measured and not adopted (docs/blas.md): each product's operands swapped,
``(W @ x.T).T``, with its rows topped up to whole blocks of 8 and 8 rows more. On the Zen 3's OpenBLAS a row's
bytes in that form are the same at every count (checked here for 1..*widest* rows of every tiled shape, the
pads random), for 8 * ceil(n / 8) + 8 rows where the tiles pay 12 * ceil(n / 6); and, for reference, the rows
multiplied as they are (``plain``: what mlx-lm does, no row's bytes its own).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from benchmarks._common import mtp_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--positions", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--swapped", action="store_true", help="also the products' operands swapped, and plain rows")
    args = parser.parse_args()

    from mlx_lm import load

    from mlxcel.models.attention import mlx_thread
    from mlxcel.models.row_exact import measure
    from mlxcel.models.row_kernels import kernel_class
    from mlxcel.models.turned_weights import turn

    path = mtp_model("aligned", 0.001, 12, 1024, 4096, True)
    with mlx_thread():
        model, _ = load(str(path))
        turn(model)  # as the server stores them (mlxcel.models.turned_weights)
        widest = max(args.widths) * max(args.positions)
        started = time.perf_counter()
        split = measure(model, max(args.positions), max_batch=max(args.widths))
        print(f"model: {path.name}; measured in {time.perf_counter() - started:.1f} s: "
              f"{len(split.tiles)} shape(s) in tiles {sorted(set(split.tiles.values()))}, "
              f"{len(split.chunks)} chunked, {len(split.pads)} padded")
        if not split.tiles:
            print("this BLAS lays no shape in tiles: the run and tiles columns are the same products")
        # Every float layer, split or not (a shape measure() left alone is multiplied as mlx does on every side).
        layers = [m for _, m in model.named_modules() if isinstance(m, nn.Linear) and m.weight.dtype == mx.float32]
        # The run each tiled shape would keep to otherwise: the first that reaches two rows, cut at its end.
        runs: dict[tuple[int, int], tuple[int, int] | None] = {}
        for layer in layers:
            shape = tuple(layer.weight.shape)
            if shape in split.tiles and shape not in runs:
                block = mx.random.normal((widest, shape[1]), key=mx.random.key(0))
                runs[shape] = kernel_class(layer, block)
        tiles, chunks, pads = dict(split.tiles), dict(split.chunks), dict(split.pads)  # as measured
        run_chunks = {**chunks, **{shape: run[1] for shape, run in runs.items() if run is not None}}
        run_pads = {**pads, **{shape: run[0] for shape, run in runs.items() if run is not None and run[0] > 1}}
        print(f"the runs those shapes keep to otherwise: {sorted(set(runs.values()), key=str)}")

        def through(block: Any, multiplies: list[Any] | None = None) -> Any:
            return [multiply(block[..., :layer.weight.shape[1]])
                    for layer, multiply in zip(layers, multiplies or layers, strict=True)]

        def best(width: int, positions: int, multiplies: list[Any] | None = None) -> float:
            block = mx.random.normal((width, positions, max(m.weight.shape[1] for m in layers)),
                                     key=mx.random.key(1))
            mx.eval(block)
            times = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                mx.eval(through(block, multiplies))
                times.append(time.perf_counter() - started)
            return min(times) * 1000

        if args.swapped:
            print(f"the swapped layout gives a row the same bytes at every count 1..{widest}: "
                  f"{all(swapped_holds(layer, widest) for layer in layers if tuple(layer.weight.shape) in tiles)}")
        print(f"{'rows x positions':>17} {'run (ms)':>9} {'tiles (ms)':>10} {'run / tiles':>11}"
              + (f" {'swapped (ms)':>11} {'tiles / swapped':>14} {'plain (ms)':>10}" if args.swapped else ""))
        for positions in args.positions:
            for width in args.widths:
                if positions > 1:
                    split.active = True  # a rows verify's block: cut or tiled as a step is
                split.tiles, split.chunks, split.pads = {}, run_chunks, run_pads
                run = best(width, positions)
                split.tiles, split.chunks, split.pads = tiles, chunks, pads
                tiled = best(width, positions)
                line = f"{width:>10} x {positions:<4} {run:9.2f} {tiled:10.2f} {run / tiled:11.2f}"
                if args.swapped:
                    split.tiles = {}
                    plain = best(width, positions)  # the tiled shapes as they are: not exact
                    swapped = best(width, positions, [_swapped(layer) if tuple(layer.weight.shape) in tiles else layer
                                                     for layer in layers])
                    split.tiles = tiles
                    line += f" {swapped:11.2f} {tiled / swapped:14.2f} {plain:10.2f}"
                split.active = False
                print(line)


def _swapped_rows(count: int) -> int:
    """The rows a swapped product of *count* rows is topped up to: whole blocks of 8, then 8 more."""
    return 8 * -(-count // 8) + 8


def _swapped(layer: Any) -> Any:
    """*layer*'s product, operands swapped, rows topped up to 8 * ceil(n / 8) + 8 (zero rows), bias added after."""
    def multiply(x: Any) -> Any:
        rows = x.reshape(-1, x.shape[-1])
        count = rows.shape[0]
        out = mx.matmul(layer.weight, mx.pad(rows, [(0, _swapped_rows(count) - count), (0, 0)]).T).T[:count]
        if "bias" in layer:
            out = out + layer.bias
        return out.reshape(*x.shape[:-1], -1)
    return multiply


def swapped_holds(layer: Any, widest: int) -> bool:
    """Whether every product of 1..*widest* rows, operands swapped and topped up with random rows, gives each row
    the bytes it has in the swapped product of all of them."""
    rows = mx.random.normal((widest, layer.weight.shape[1]), key=mx.random.key(2))
    every = mx.matmul(layer.weight, mx.pad(rows, [(0, _swapped_rows(widest) - widest), (0, 0)]).T).T[:widest]
    for count in range(1, widest + 1):
        pads = mx.random.normal((_swapped_rows(count) - count, rows.shape[1]), key=mx.random.key(count))
        out = mx.matmul(layer.weight, mx.concatenate([rows[:count], pads]).T).T[:count]
        if not mx.array_equal(out, every[:count]).item():
            return False
    return True


if __name__ == "__main__":
    main()
