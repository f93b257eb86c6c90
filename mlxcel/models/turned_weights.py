"""Float linear weights kept the other way round in memory on the CPU backend, for the BLAS's sake.

``nn.Linear`` multiplies ``x @ W.T`` with its weight stored (out, in). mlx hands that to the BLAS as a
transposed operand, and OpenBLAS (0.3.21 on the Zen 3 machine) packs a transposed operand more slowly: the
same products from weights stored (in, out) took 0.7-0.83 of the time at 1 to 24 rows, and mlx-lm's decode
of a 1 GB model ran 1.26x as fast (docs/blas.md, "A weight stored the other way round"). Decode's products
are exactly those: a few rows against every weight of the model.

:func:`turn` stores such a weight (in, out) and leaves the layer a transposed *view* of it, so the layer
still reads (out, in) to everything that looks (its shape, the row split's keys, ``mx.quantize`` through a
copy) and ``weight.T``, what ``nn.Linear`` multiplies by, is the stored array itself: no layer class changes,
and the memory is the weight's once. A product's rounding may differ from the untouched layer's on some BLAS
(not on that one); a row's bytes at every width are measured afterwards on the layers as they are
(:mod:`.row_exact`).
"""

from __future__ import annotations

from typing import Any

#: The fewest elements a weight is turned for: below, the products are too small for the packing to
#: matter, and the tests' tiny models (64 wide) stay exactly as mlx-lm multiplies them.
TURN_ELEMENTS = 1 << 18


def turn(model: Any) -> int:
    """Store every float ``nn.Linear`` weight of *model* with :data:`TURN_ELEMENTS` or more elements (in, out),
    the layer keeping a transposed view (CPU backend only; evaluated one at a time, so the memory peaks at one
    weight's copy). Returns how many were turned."""
    import mlx.core as mx
    import mlx.nn as nn

    if mx.default_device() != mx.cpu:
        return 0
    turned = 0
    for _, layer in model.named_modules():
        if not isinstance(layer, nn.Linear) or "weight" not in layer:
            continue
        weight = layer.weight
        if not mx.issubdtype(weight.dtype, mx.floating) or weight.ndim != 2 or weight.size < TURN_ELEMENTS:
            continue
        layer.weight = mx.contiguous(weight.T).T
        mx.eval(layer.weight)
        turned += 1
    return turned
