"""The row-split verify's matmuls: found by measurement, split a row at a time, and only while asked."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxcel.models import row_exact
from tests.checkpoints import build_mtp_checkpoint


@pytest.mark.requires_openblas  # the inexact shapes are OpenBLAS's; CI requires it
def test_measured_shapes_multiply_like_one_row_only_inside_rows_apart(tmp_path: Path) -> None:
    from mlx_lm import load

    model, _ = load(str(build_mtp_checkpoint(tmp_path / "qwen35", drafter="aligned", context_scale=0.05)))
    inexact, share = row_exact.measure(model, 8)
    assert inexact and 0 < share < 1  # this machine's OpenBLAS: some shapes, not all
    layers = {tuple(m.weight.shape): m for _, m in model.named_modules() if isinstance(m, nn.Linear)}
    x_key = mx.random.key(1)
    for shape in inexact:
        layer = layers[shape]
        x = mx.random.normal((1, 8, shape[1]), key=x_key)
        one_by_one = mx.concatenate([layer(x[:, i:i + 1]) for i in range(8)], axis=1)
        assert not mx.array_equal(layer(x), one_by_one).item()  # the kernel switch, measured again
        with row_exact.rows_apart():
            assert mx.array_equal(layer(x), one_by_one).item()
        assert not mx.array_equal(layer(x), one_by_one).item()  # the patch is gone again
    exact = next(s for s in layers if s not in inexact)
    x = mx.random.normal((1, 8, exact[1]), key=x_key)
    whole = layers[exact](x)
    with row_exact.rows_apart():  # a shape that multiplies exactly stays one product
        assert mx.array_equal(layers[exact](x), whole).item()
