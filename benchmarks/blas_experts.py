"""Whether an MoE's expert products give a (token, expert) pair the same bytes on mlx-lm's two paths, per shape.

    [MLXCEL_BLAS=openblas|mkl] python -m benchmarks.blas_experts

mlx-lm's ``SwitchGLU`` multiplies 64 (token, expert) pairs or more sorted by expert (each pair a flat row of
``gather_mm``), and fewer broadcast (a token against its experts). A lone step (top-k pairs) takes the broadcast
path, a batch's step of 16 rows at top 4 or a verify the sorted one: where the two round otherwise a row's step is
not its bytes alone, and a verify not its steps. For each expert shape (in, out: the released GLM-4.7-Flash and
Qwen MoE shapes, and the tiny ones tests build), on this process's BLAS: whether the broadcast path gives the
sorted path's bytes, and whether mlxcel's flat pairs (``models/row_exact.py``, on the MLX thread) do. Then what
the flat pairs cost: a ``SwitchGLU`` of GLM-4.7-Flash's expert size (16 of its 64 experts, top 4) at 1, 2 and 8
rows, mlx-lm's products and the flat pairs taking turns, median milliseconds of 15 calls each.
"""

from __future__ import annotations

import time

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx_lm.models.switch_layers import SwitchGLU, SwitchLinear  # noqa: E402

from mlxcel.models import row_exact  # noqa: E402
from mlxcel.models.attention import mlx_thread  # noqa: E402

#: (in, out) of an expert's products: GLM-4.7-Flash's gate/up and down, the Qwen MoE targets' (512 and 768 wide),
#: then smaller ones down to the tests' tiny models.
SHAPES = [(2048, 1536), (1536, 2048), (2048, 512), (512, 2048), (2048, 768), (768, 2048), (1024, 512),
          (512, 1024), (256, 128), (128, 256), (64, 32), (32, 64)]


def main() -> None:
    experts, top, rows = 8, 4, 3
    print(f"{'in':>5} {'out':>5}  broadcast = sorted  flat pairs = sorted")
    for inputs, outputs in SHAPES:
        layer = SwitchLinear(inputs, outputs, experts, bias=False)
        mx.eval(layer.parameters())
        x = mx.expand_dims(mx.random.normal((rows, 1, inputs), key=mx.random.key(3)), (-2, -3))
        chosen = mx.argpartition(-mx.random.normal((rows, 1, experts), key=mx.random.key(7)), top - 1,
                                 axis=-1)[..., :top]
        pairs = x.flatten(0, -3)[mx.arange(rows * top) // top]  # as mlx-lm's sort lays them out, unsorted
        flat = chosen.flatten()
        sorted_path = mx.concatenate([layer(pairs[i:i + 1], flat[i:i + 1], sorted_indices=True)
                                      for i in range(rows * top)]).reshape(rows, 1, top, 1, outputs)
        broadcast = layer(x, chosen)
        row_exact.measure(nn.Sequential(layer), max_rows=4, max_batch=16)  # the server's model, measured
        with mlx_thread():
            mended = layer(x, chosen)
        print(f"{inputs:>5} {outputs:>5}  {mx.array_equal(broadcast, sorted_path).item()!s:>17}  "
              f"{mx.array_equal(mended, sorted_path).item()!s:>19}")


def cost() -> None:
    experts = SwitchGLU(2048, 1536, 16)
    mx.eval(experts.parameters())
    flat = row_exact._flat_pairs()
    with mlx_thread():
        for rows in (1, 2, 8):
            x = mx.random.normal((rows, 1, 2048))
            chosen = mx.argpartition(-mx.random.normal((rows, 1, 16)), 3, axis=-1)[..., :4]
            mx.eval(x, chosen)
            times: dict[type, list[float]] = {SwitchLinear: [], flat: []}
            for turn in range(30):
                kind = (SwitchLinear, flat)[turn % 2]
                for layer in (experts.up_proj, experts.gate_proj, experts.down_proj):
                    layer.__class__ = kind
                began = time.perf_counter()
                mx.eval(experts(x, chosen))
                times[kind].append(time.perf_counter() - began)
            ms = {kind: sorted(t)[len(t) // 2] * 1000 for kind, t in times.items()}
            print(f"{rows} rows: mlx-lm's products {ms[SwitchLinear]:.1f} ms, flat pairs {ms[flat]:.1f} ms "
                  f"({ms[flat] / ms[SwitchLinear]:.2f}x)")


if __name__ == "__main__":
    main()
    cost()
