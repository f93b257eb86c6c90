"""The row-split verify's matmuls: found by measurement, split a row at a time, and only while asked."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from mlxcel.models import attention, row_exact, row_kernels


def _off_the_mlx_thread(call: Callable[[mx.array], mx.array], x: mx.array) -> mx.array:
    """*call*(x) on a thread of its own (not an MLX thread: mlx's products and attention, untouched)."""
    out: list[mx.array] = []
    mx.eval(x)
    thread = threading.Thread(target=lambda: out.append(mx.eval(y := call(x)) or y))
    thread.start()
    thread.join()
    return out[0]


@pytest.mark.requires_openblas  # the width-dependent shapes are OpenBLAS's; CI requires it
def test_measured_shapes_give_each_row_the_same_bytes_at_every_width(tmp_path: Path, on_an_mlx_thread: None) -> None:
    from mlx_lm import load

    model, _ = load(str(build_mtp_checkpoint(tmp_path / "qwen35", drafter="aligned", context_scale=0.05)))
    split = row_exact.measure(model, 8)
    measured = split.pads.keys() | split.chunks.keys() | split.tiles.keys()
    assert measured  # this machine's OpenBLAS switches kernel for some small weights
    assert row_exact.measure(model, 4) is split  # measured once per model
    layers = {tuple(m.weight.shape): m for _, m in model.named_modules() if isinstance(m, nn.Linear)}
    x_key = mx.random.key(1)
    for shape in measured:
        layer = layers[shape]
        x = mx.random.normal((1, 8, shape[1]), key=x_key)
        one_by_one = mx.concatenate([layer(x[:, i:i + 1]) for i in range(8)], axis=1)
        # mlx's own products: a row's bytes move with how many rows share its product.
        mlx_rows = mx.concatenate([_off_the_mlx_thread(layer, x[:, i:i + 1]) for i in range(8)], axis=1)
        assert not mx.array_equal(_off_the_mlx_thread(layer, x), mlx_rows).item()
        # On the MLX thread a step of any width (one position a row) and a rows verify give each row the same
        # bytes as its step alone.
        steps = x.reshape(8, 1, shape[1])
        for width in range(1, 9):
            assert mx.array_equal(layer(steps[:width]).reshape(1, width, -1), one_by_one[:, :width]).item()
        with row_exact.rows_apart(model):
            assert mx.array_equal(layer(x), one_by_one).item()
    exact = next(s for s in layers if s not in measured)
    assert not hasattr(layers[exact], "row_split")
    # Another model of the same shapes, never measured, is untouched.
    other, _ = load(str(build_mtp_checkpoint(tmp_path / "other", drafter="aligned", context_scale=0.05)))
    shape = next(iter(measured))
    twin = next(m for _, m in other.named_modules() if isinstance(m, nn.Linear) and tuple(m.weight.shape) == shape)
    x = mx.random.normal((1, 8, shape[1]), key=x_key)
    assert not mx.array_equal(twin(x), mx.concatenate([twin(x[:, i:i + 1]) for i in range(8)], axis=1)).item()


def test_a_kept_split_adopted_by_a_fresh_model_is_the_one_measured(tmp_path: Path, on_an_mlx_thread: None) -> None:
    """A restart adopts the split an earlier start measured, kept with the exactness probes' outcomes
    (:mod:`mlxcel.engine.probe_memo`): the same layers pad and chunk, with the same split, and a step of a
    measured shape gives each row the bytes it gives in the model that measured it."""
    from mlx_lm import load

    from mlxcel.engine.probe_memo import ProbeMemo
    from mlxcel.policy import HintStore, PairingKey

    path = build_mtp_checkpoint(tmp_path / "qwen35", drafter="aligned", context_scale=0.05)
    (measured, _), (fresh, _) = load(str(path)), load(str(path))
    split = row_exact.measure(measured, 4, max_batch=5)
    key, hints = PairingKey("qwen35", "qwen35#mtp", "cpu-test", 4), HintStore(tmp_path / "cache", {"mlx": "1"})
    ProbeMemo(hints, key, {"blas": "this one"}).save_split(split)
    kept = ProbeMemo(hints, key, {"blas": "this one"}).split(4, 5)
    assert kept is not None and row_exact.adopt(fresh, kept) is kept

    def classes(model: nn.Module) -> list[tuple[str, str]]:
        return [(name, type(module).__name__) for name, module in model.named_modules()]

    def fields(split: row_exact.RowSplit) -> tuple[object, ...]:
        return (split.chunks, split.pads, split.tiles, split.batch_shapes, split.share, split.max_rows,
                split.max_batch, split.steps)

    assert classes(fresh) == classes(measured) and any(name.startswith("RowSplit") for _, name in classes(fresh))
    assert fields(fresh.row_split) == fields(measured.row_split)
    for shape in split.pads.keys() | split.chunks.keys():
        mine, theirs = (next(m for _, m in model.named_modules()
                             if isinstance(m, nn.Linear) and tuple(m.weight.shape) == shape)
                        for model in (fresh, measured))
        steps = mx.random.normal((5, 1, shape[1]), key=mx.random.key(2))
        assert mx.array_equal(mine(steps), theirs(steps)).item(), shape


@pytest.mark.requires_openblas
def test_a_chunked_shape_multiplies_a_rows_verify_a_row_at_a_time(on_an_mlx_thread: None) -> None:
    # The fallback for a shape whose larger products do not all agree: chunks of rows that give each row its
    # one-row bytes, inside a rows verify (and in steps of one position a row).
    layer = nn.Linear(64, 512)
    x = mx.random.normal((1, 8, 64), key=mx.random.key(1))
    one_by_one = mx.concatenate([layer(x[:, i:i + 1]) for i in range(8)], axis=1)
    assert not mx.array_equal(layer(x), one_by_one).item()  # the kernel switch
    model = nn.Sequential(layer)
    split = row_exact.RowSplit({(512, 64): 1}, 1.0, max_rows=8)
    layer.__class__ = row_exact._by_rows(nn.Linear)
    layer.row_split = split
    model.row_split = split
    assert not mx.array_equal(layer(x), one_by_one).item()  # a block of positions: whole outside a verify
    with row_exact.rows_apart(model):
        assert mx.array_equal(layer(x), one_by_one).item()
    steps = x.reshape(8, 1, 64)  # 8 rows, one position each: a batch's step
    assert mx.array_equal(layer(steps).reshape(1, 8, 512), one_by_one).item()


def test_a_rows_verify_refuses_to_run_off_the_thread_that_measured_it() -> None:
    split = row_exact.RowSplit({}, 0.0)
    failures: list[BaseException] = []

    def elsewhere() -> None:
        try:
            with split.apart():
                pass
        except AssertionError as exc:
            failures.append(exc)

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    assert len(failures) == 1 and not split.active


def test_inside_rows_apart_each_query_attends_as_its_own_step_would() -> None:
    # 3 heads of 64 over one KV head (the bundled pairing's attention): a causal block of 2 queries over
    # 12 cached positions. Each query must attend as the step at its position did: a lone query over its own
    # prefix (causal), or over every slot with its own row of the mask (a sliding window's ring), through the
    # same rule as that step (on the CPU, grouped_attention's), so nothing reaches mlx's kernel.
    mlx_own = mx.fast.scaled_dot_product_attention  # outside mlx_thread(): mlx's own, dispatcher or not
    calls: list[tuple[int, int, object]] = []

    def recorded(q: mx.array, k: mx.array, v: mx.array, **kwargs: object) -> mx.array:
        mask = kwargs.get("mask")
        calls.append((q.shape[2], k.shape[2], mask if mask is None or isinstance(mask, str) else "array"))
        return mlx_own(q, k, v, **kwargs)  # type: ignore[arg-type]

    attend = attention.dispatching(recorded)  # what mlx_thread() installs, over a recorder
    q = mx.random.normal((1, 3, 2, 64), key=mx.random.key(0))
    k, v = (mx.random.normal((1, 1, 12, 64), key=mx.random.key(i)) for i in (1, 2))
    window = mx.arange(12)[None] <= mx.array([[10], [11]])
    with attention.mlx_thread():
        steps = mx.concatenate([attend(q[:, :, i:i + 1], k[:, :, :11 + i], v[:, :, :11 + i], scale=0.125)
                                for i in range(2)], axis=2)
        rows = mx.concatenate([attend(q[:, :, i:i + 1], k, v, scale=0.125, mask=window[i:i + 1])
                               for i in range(2)], axis=2)
        whole = attend(q[:, :, 1:], k, v, scale=0.125)
        assert not mx.array_equal(steps[:, :, :1], attend(q[:, :, :1], k, v, scale=0.125)).item()  # prefixes count
        with row_exact.rows_apart(None):
            assert mx.array_equal(attend(q, k, v, scale=0.125, mask="causal"), steps).item()
            assert mx.array_equal(attend(q, k, v, scale=0.125, mask=window), rows).item()
            assert mx.array_equal(attend(q[:, :, 1:], k, v, scale=0.125), whole).item()  # one query: as ever
        assert not calls  # every one of those was a lone query: grouped, never mlx's kernel
        attend(q, k, v, scale=0.125, mask="causal")  # the rows verify closed: the block attends whole again
    assert calls == [(2, 12, "causal")]


@pytest.mark.requires_openblas
def test_a_shape_padded_and_cut_gives_each_row_the_bytes_of_its_kernel(on_an_mlx_thread: None) -> None:
    # Where the run of row counts that share a kernel ends (MKL: 2-15 rows), a wider product is cut into pieces
    # within it, the last piece topped up. OpenBLAS's runs at 512 x 64 are the machine's: 3 rows on (the
    # machines of the first sessions), 1-3 (this project's machine of 2026-12-07, whose 4-8 rows each round
    # otherwise). The oracle: each row in a product of the run's fewest rows, those after it filling the rest.
    layer = nn.Linear(64, 512)
    x = mx.random.normal((1, 8, 64), key=mx.random.key(1))
    kernel = row_kernels.kernel_class(layer, x[0])
    if kernel is None:  # measure() multiplies such a shape in chunks of one-row bytes instead
        pytest.skip("this BLAS's runs of row counts at 512 x 64 come back or move a row's bytes: no run to keep")
    low, high = kernel
    if low == 1 and high >= 8:
        pytest.skip("this BLAS gives a row of 512 x 64 the same bytes at every count: nothing to pad or cut")
    rows = x[0]
    own = mx.stack([layer(mx.concatenate([rows[i:], rows[:i]])[:low])[0] for i in range(8)])[None]
    assert not mx.array_equal(layer(x), own).item() or not mx.array_equal(layer(x[:, :1]), own[:, :1]).item()
    model = nn.Sequential(layer)
    chunk = min(high, 4)
    split = row_exact.RowSplit({(512, 64): chunk}, 0.0, max_rows=8, pads={(512, 64): low} if low > 1 else {})
    layer.__class__ = row_exact._by_rows(nn.Linear)
    layer.row_split = split
    model.row_split = split
    for width in range(1, min(high, 8) + 1):  # a block of positions is one product outside a rows verify
        assert mx.array_equal(layer(x[:, :width]), own[:, :width]).item()  # topped up, or within the run
    with row_exact.rows_apart(model):
        assert mx.array_equal(layer(x), own).item()  # cut into pieces of the run
    steps = x.reshape(8, 1, 64)[:5]  # a batch's step of 5 rows: cut, the last piece topped up
    assert mx.array_equal(layer(steps).reshape(1, 5, 512), own[:, :5]).item()


@pytest.mark.requires_openblas  # the broadcast products' rounding is OpenBLAS's; CI requires it
def test_an_moes_gathered_experts_give_each_row_and_position_its_lone_bytes(on_an_mlx_thread: None) -> None:
    """mlx-lm's ``SwitchGLU`` (GLM-4.7-Flash's and the Qwen MoE targets' experts) multiplies 64 (token,
    expert) pairs or more sorted by expert, fewer broadcast, and at this size the two round otherwise: a lone
    step was not its row's bytes in a batch's step. Measured, the model's experts multiply every pair as the
    sorted path does, so a row and a verify's position are their lone step's bytes at every width."""
    from mlx_lm.models.switch_layers import SwitchGLU

    model = nn.Sequential(SwitchGLU(256, 128, 16))
    experts = model.layers[0]
    x = mx.random.normal((16, 4, 256), key=mx.random.key(3))
    chosen = mx.argpartition(-mx.random.normal((16, 4, 16), key=mx.random.key(7)), 3, axis=-1)[..., :4]
    whole = experts(x, chosen)  # 256 pairs: sorted
    # 4 pairs: broadcast. Some machines' OpenBLAS rounds the two paths alike here (2026-12-07's), others not.
    otherwise = not mx.array_equal(experts(x[:1, :1], chosen[:1, :1]), whole[:1, :1]).item()
    row_exact.measure(model, max_rows=4, max_batch=16)
    assert mx.array_equal(experts(x, chosen), whole).item()
    for rows, positions in ((1, 1), (3, 1), (16, 1), (2, 4)):  # steps, a verify
        part = experts(x[:rows, :positions], chosen[:rows, :positions])
        assert mx.array_equal(part, whole[:rows, :positions]).item(), (rows, positions)
    alone_elsewhere = _off_the_mlx_thread(lambda v: experts(v, chosen[:1, :1]), x[:1, :1])
    assert mx.array_equal(alone_elsewhere, whole[:1, :1]).item() is not otherwise  # off the MLX thread, mlx-lm's


def test_an_moes_quantized_experts_round_alike_on_both_paths(on_an_mlx_thread: None) -> None:
    """Quantized experts (``gather_qmm``) are left as mlx-lm multiplies them: broadcast (a lone step's few pairs)
    and sorted (a batch's or a verify's 64 or more) give a pair the same bytes."""
    from mlx_lm.models.switch_layers import SwitchGLU

    model = nn.Sequential(SwitchGLU(256, 128, 16))
    nn.quantize(model, bits=4, group_size=64)
    experts = model.layers[0]
    row_exact.measure(model, max_rows=4, max_batch=16)
    x = mx.random.normal((16, 4, 256), key=mx.random.key(3))
    chosen = mx.argpartition(-mx.random.normal((16, 4, 16), key=mx.random.key(7)), 3, axis=-1)[..., :4]
    whole = experts(x, chosen)  # 256 pairs: sorted
    assert type(experts.up_proj).__name__ == "QuantizedSwitchLinear"  # not swapped
    for row, position in ((0, 0), (5, 3), (15, 1)):
        alone = experts(x[row:row + 1, position:position + 1], chosen[row:row + 1, position:position + 1])
        assert mx.array_equal(alone, whole[row:row + 1, position:position + 1]).item(), (row, position)


@pytest.mark.requires_openblas
def test_a_tiled_shape_gives_each_row_the_bytes_of_a_tiles_first_place_at_any_width_and_order(
        on_an_mlx_thread: None) -> None:
    # Where a GEMM's kernel rounds a row by its place in a tile of rows (OpenBLAS on a Zen 3: tiles of 12, the
    # second six places otherwise), rows laid in the tiles' first places keep their bytes whatever the width.
    # The oracle: each row alone in the first place of a tile of zero rows, one plain product of mlx.
    # Which widths round otherwise depends on the kernels: on a Zen 3 (Haswell's) a 40-row product does; on a
    # Zen 4 (Cooperlake's) a product of 1 or 2 rows of this small shape does (another kernel for small
    # products), and wider ones are the tile's. So "mlx's product rounds by width" is: at some width.
    layer = nn.Linear(64, 512)
    block = mx.random.normal((40, 64), key=mx.random.key(3))
    layout = row_kernels.tile(layer, block)
    if layout is None:
        pytest.skip("this BLAS rounds no row of 512 x 64 alike at every width in tiles of up to 16 rows")
    size, slots = layout
    own = mx.stack([layer(mx.concatenate([block[i:i + 1], mx.zeros((size - 1, 64))]))[0] for i in range(40)])
    widths = (1, 2, slots - 1, slots, slots + 1, size, 17, 40)

    def rounds_by_width() -> bool:
        """Whether mlx's own product, off the MLX thread, gives some width's rows other bytes than the tile's."""
        return not all(mx.array_equal(_off_the_mlx_thread(layer, block[:width]), own[:width]).item()
                       for width in widths)

    assert rounds_by_width()
    model = nn.Sequential(layer)
    split = row_exact.RowSplit({}, 0.0, max_rows=1, max_batch=40, tiles={(512, 64): layout})
    layer.__class__ = row_exact._by_rows(nn.Linear)
    layer.row_split = split
    model.row_split = split
    steps = block.reshape(40, 1, 64)  # a batch's step: one position a row
    for width in widths:
        assert mx.array_equal(layer(steps[:width])[:, 0], own[:width]).item(), width
    order = mx.array([(7 * i) % 40 for i in range(40)])  # every row elsewhere in the batch
    assert mx.array_equal(layer(steps[order])[:, 0], own[order]).item()
    assert rounds_by_width()  # another thread's product: mlx's own, not the tiles
