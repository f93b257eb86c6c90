"""A step's products laid in tiles against cut into one kernel's run, side by side: what each costs a step.

    python -m benchmarks.row_tiles [--widths 1 2 4 8 16] [--positions 1 4] [--repeats 7]

``mlxcel.models.row_exact.measure`` gives every row its own bytes at any width one of two ways (see its
docstring): products kept within the run of row counts that share a kernel, cut into pieces of it (``run``),
or rows laid a few to a tile of rows that one kernel multiplies alike (``tiles``). On OpenBLAS on a Zen 3
the run a lone row is in ends at 3 rows and the tiles hold 6 rows of 12. Here the ``--released`` pairing's
target layers (``benchmarks/batch_mtp.py``: Qwen3.5-0.8B's shapes, 12 layers, ~1 GB fp32) multiply a block
of *width* rows x *positions* positions (a batch's step at 1, a verify's block at K + 1) through every float
linear layer, both ways, on the MLX thread (the shapes measure() leaves out of tiles, weights under a million
elements, as it measured them on both sides); prints the best of *repeats* milliseconds and the ratio. Where
this BLAS has no tiles, its first line says so, and both sides are the same.
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
    args = parser.parse_args()

    from mlx_lm import load

    from mlxcel.models.attention import mlx_thread
    from mlxcel.models.row_exact import measure
    from mlxcel.models.row_kernels import kernel_class

    path = mtp_model("aligned", 0.001, 12, 1024, 4096, True)
    with mlx_thread():
        model, _ = load(str(path))
        widest = max(args.widths) * max(args.positions)
        started = time.perf_counter()
        split = measure(model, max(args.positions), max_batch=max(args.widths))
        print(f"model: {path.name}; measured in {time.perf_counter() - started:.1f} s: "
              f"{len(split.tiles)} shape(s) in tiles {sorted(set(split.tiles.values()))}, "
              f"{len(split.chunks)} chunked, {len(split.pads)} padded")
        layers = [m for _, m in model.named_modules()
                  if isinstance(m, nn.Linear) and hasattr(m, "row_split") and m.weight.dtype == mx.float32]
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

        def through(block: Any) -> Any:
            return [layer(block[..., :layer.weight.shape[1]]) for layer in layers]

        def best(width: int, positions: int) -> float:
            block = mx.random.normal((width, positions, max(m.weight.shape[1] for m in layers)),
                                     key=mx.random.key(1))
            mx.eval(block)
            times = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                mx.eval(through(block))
                times.append(time.perf_counter() - started)
            return min(times) * 1000

        print(f"{'rows x positions':>17} {'run (ms)':>9} {'tiles (ms)':>10} {'run / tiles':>11}")
        for positions in args.positions:
            for width in args.widths:
                if positions > 1:
                    split.active = True  # a rows verify's block: cut or tiled as a step is
                split.tiles, split.chunks, split.pads = {}, run_chunks, run_pads
                run = best(width, positions)
                split.tiles, split.chunks, split.pads = tiles, chunks, pads
                tiled = best(width, positions)
                split.active = False
                print(f"{width:>10} x {positions:<4} {run:9.2f} {tiled:10.2f} {run / tiled:11.2f}")


if __name__ == "__main__":
    main()
