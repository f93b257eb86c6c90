"""A vision tower's attention and GELU on the CPU: mlx's own against mlxcel's, by numpy.

    python -m benchmarks.cpu_tower [--repeats 5]

For the attention shapes of the towers mlxcel serves (one image's patches attending to each other, every head),
``mx.fast.scaled_dot_product_attention`` as mlx ships it (what mlx-vlm's ``ensure_fused_sdpa`` calls) and
``mlxcel.models.cpu_tower.attention``, interleaved in one process on the same arrays: milliseconds each, the
ratio and the largest difference; then the towers' MLP activation (``mlx.nn.gelu_approx`` against
``mlxcel.models.cpu_tower.gelu_approx``) over patches x MLP width. Also ``mx.exp`` against numpy's ``exp``, the cause.
The fast BLAS (section 9) is loaded first.
"""

from __future__ import annotations

import argparse
import functools
import time

from benchmarks._common import interleaved_ms
from mlxcel.blas import load_fast_blas

#: (what, patches, heads, head size): the tiny test towers, and a 1024 x 768 screenshot through the benchmark's
#: large Gemma 4 tower (280 soft tokens of 3 x 3 patches) and Qwen 3.5's (768 tokens of 2 x 2 patches).
SHAPES = [("tiny Gemma 4", 567, 2, 16), ("tiny Qwen 3.5", 256, 2, 16), ("Gemma 4, screenshot", 2520, 12, 64),
          ("Qwen 3.5, screenshot", 3072, 12, 64)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(load_fast_blas())
    import mlx.core as mx
    import numpy as np

    from mlxcel.models.cpu_tower import attention, gelu_approx

    scores = mx.random.normal((1024, 1024))
    mx.eval(scores)
    values = np.array(scores)
    mlx_exp = interleaved_ms({"mlx": lambda: mx.exp(scores)}, args.repeats)["mlx"]
    started = time.perf_counter()
    for _ in range(args.repeats):
        np.exp(values)
    numpy_exp = 1e3 * (time.perf_counter() - started) / args.repeats
    print(f"exp of 1M floats: mlx {mlx_exp:.2f} ms, numpy {numpy_exp:.2f} ms ({mlx_exp / numpy_exp:.1f}x)")
    print(f"{'shape':<22} {'patches':>7} {'heads':>5} {'mlx ms':>9} {'mlxcel ms':>9} {'ratio':>6} {'max diff':>9}")
    for what, patches, heads, dim in SHAPES:
        mx.random.seed(patches)
        q, k, v = (mx.random.normal((1, heads, patches, dim)) for _ in range(3))
        scale = dim ** -0.5
        theirs = functools.partial(mx.fast.scaled_dot_product_attention, q, k, v, scale=scale)
        ours = functools.partial(attention, q, k, v, scale)
        timing = interleaved_ms({"mlx": theirs, "mlxcel": ours}, args.repeats)
        difference = mx.abs(ours() - theirs())
        print(f"{what:<22} {patches:>7} {heads:>5} {timing['mlx']:>9.1f} {timing['mlxcel']:>9.1f} "
              f"{timing['mlx'] / timing['mlxcel']:>6.2f} {float(difference.max()):>9.1e}")

    import mlx.nn as nn

    print(f"{'GELU':<22} {'patches':>7} {'width':>5} {'mlx ms':>9} {'mlxcel ms':>9} {'ratio':>6} {'max diff':>9}")
    for what, patches, width in (("Gemma 4, screenshot", 2520, 3072), ("Qwen 3.5, screenshot", 3072, 3072)):
        x = mx.random.normal((patches, width))
        timing = interleaved_ms({"mlx": functools.partial(nn.gelu_approx, x),
                                 "mlxcel": functools.partial(gelu_approx, x)}, args.repeats)
        difference = float(mx.abs(gelu_approx(x) - nn.gelu_approx(x)).max())
        print(f"{what:<22} {patches:>7} {width:>5} {timing['mlx']:>9.1f} {timing['mlxcel']:>9.1f} "
              f"{timing['mlx'] / timing['mlxcel']:>6.2f} {difference:>9.1e}")


if __name__ == "__main__":
    main()
