"""Large float weights stored (in, out) on the CPU backend (mlxcel.models.turned_weights)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxcel.models import row_exact, row_kernels
from mlxcel.models.turned_weights import TURN_ELEMENTS, turn


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.large = nn.Linear(256, TURN_ELEMENTS // 256)
        self.small = nn.Linear(64, 64)


def test_a_large_weight_multiplies_as_a_weight_stored_in_out_and_reads_as_before() -> None:
    if mx.default_device() != mx.cpu:
        pytest.skip("weights are turned on the CPU backend only")
    model = _Two()
    mx.eval(model.parameters())
    stored = np.array(model.large.weight)
    small = model.small.weight
    assert np.asarray(model.large.weight).flags["C_CONTIGUOUS"]  # as loaded: (out, in) in memory
    assert turn(model) == 1
    # In memory (mlx's buffer gives numpy its strides): (in, out), what the layer multiplies by, weight.T.
    assert np.asarray(model.large.weight.T).flags["C_CONTIGUOUS"]
    assert not np.asarray(model.large.weight).flags["C_CONTIGUOUS"]
    # To everything that looks, the weight is what it was: its shape, its values.
    assert model.large.weight.shape == stored.shape
    assert np.array_equal(np.array(model.large.weight), stored)
    assert model.small.weight is small  # under TURN_ELEMENTS: untouched
    # The product: the one from an (in, out) array numpy laid out, plus the bias.
    x = mx.random.normal((8, 256), key=mx.random.key(0))
    by_hand = mx.addmm(model.large.bias, x, mx.array(np.ascontiguousarray(stored.T)))
    assert mx.array_equal(model.large(x), by_hand).item()
    assert turn(model) == 1  # turned again: the same values, the same layout
    assert np.array_equal(np.array(model.large.weight), stored)
    assert np.asarray(model.large.weight.T).flags["C_CONTIGUOUS"]


@pytest.mark.requires_openblas  # the tiles are OpenBLAS's; CI requires it
def test_a_turned_weight_keeps_each_rows_bytes_at_every_width_in_its_measured_tiles(on_an_mlx_thread: None) -> None:
    # The row split is measured on the layers as they are: turned, a tiled shape still gives a row one set of
    # bytes at every width. The oracle: each row alone in the first place of a tile of zero rows.
    model = _Two()
    turn(model)
    layer = model.large
    shape = tuple(layer.weight.shape)
    block = mx.random.normal((40, 256), key=mx.random.key(3))
    layout = row_kernels.tile(layer, block)
    if layout is None:
        pytest.skip(f"this BLAS rounds no row of {shape} alike at every width in tiles of up to 16 rows")
    size, slots = layout
    own = mx.stack([layer(mx.concatenate([block[i:i + 1], mx.zeros((size - 1, 256))]))[0] for i in range(40)])
    split = row_exact.RowSplit({}, 0.0, max_rows=1, max_batch=40, tiles={shape: layout})
    layer.__class__ = row_exact._by_rows(nn.Linear)
    layer.row_split = split
    model.row_split = split
    steps = block.reshape(40, 1, 256)
    for width in (1, slots - 1, slots, slots + 1, size, 17, 40):
        assert mx.array_equal(layer(steps[:width])[:, 0], own[:width]).item(), width
    order = mx.array([(7 * i) % 40 for i in range(40)])
    assert mx.array_equal(layer(steps[order])[:, 0], own[order]).item()
