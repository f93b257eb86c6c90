"""A batch's rows rolled back apart after a speculative verify: each row as if it had fed only what it kept."""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import ArraysCache, BatchKVCache, make_prompt_cache

from mlxcel.families.glm4_moe_lite.target import Glm4MoeLiteTarget
from mlxcel.families.glm4_moe_lite.tiny import build_glm_checkpoint
from mlxcel.families.qwen3_5.target import Qwen35Target
from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from mlxcel.models.batch_rollback import batch_rollback_supported, fewest_moves, rollback_kv_rows
from tests.engine.test_rollback import _arrays as _chain_arrays

pytestmark = pytest.mark.usefixtures("on_an_mlx_thread")

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2], [1, 6, 1, 8, 0, 3, 3, 9, 8, 8, 7]]
BLOCKS = [[5, 17, 99, 42], [8, 8, 2, 11], [13, 21, 34, 55]]


@pytest.fixture(scope="module", params=["qwen3_5", "glm4_moe_lite"])
def hybrid(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    """A target whose batch rolls back apart: Qwen 3.5 (attention and gated-delta layers), GLM-4.7-Flash
    (latent attention, its verify a query row at a time)."""
    root = tmp_path_factory.mktemp("batch-rollback")
    if request.param == "qwen3_5":
        model, _ = load(str(build_mtp_checkpoint(root / "qwen35", context_scale=1.0)))
        return Qwen35Target(model), model
    model, _ = load(str(build_glm_checkpoint(root / "glm")))
    return Glm4MoeLiteTarget(model), model


def _row_caches(model: Any, prompts: list[list[int]]) -> list[list[Any]]:
    caches = []
    for prompt in prompts:
        cache = make_prompt_cache(model)
        model(mx.array([prompt]), cache=cache)
        mx.eval([c.state for c in cache])
        caches.append(cache)
    return caches


def _batch(caches: list[list[Any]]) -> list[Any]:
    """The rows' caches merged as mlx-lm's batch holds them (left-padded KV, stacked recurrent state)."""
    return [type(layers[0]).merge(list(layers)) if not hasattr(layers[0], "offset")
            else BatchKVCache.merge(list(layers)) for layers in zip(*caches, strict=True)]


def _row_arrays(cache: list[Any], row: int) -> list[np.ndarray]:
    """Row *row*'s state in a batch cache: its keys and values without padding, or its recurrent arrays."""
    arrays = []
    for layer in cache:
        if isinstance(layer, BatchKVCache):
            single = layer.extract(row)
            arrays += [np.array(single.keys), np.array(single.values)]
        else:
            assert isinstance(layer, ArraysCache)
            arrays += [np.array(a[row:row + 1]) for a in layer.cache]
    return arrays


# [4, 1, 1] and [2, 1, 1]: the first row (3 of padding) moves forward, the others stay; [1, 1, 4]: the last row
# has no padding to move over, so the first two move back.
@pytest.mark.parametrize("kept", [[1, 4, 2], [4, 4, 4], [2, 2, 2], [3, 1, 4], [4, 1, 1], [2, 1, 1], [1, 1, 4]])
def test_each_row_lands_on_its_own_chain_state(hybrid: tuple[Any, Any], kept: list[int]) -> None:
    target, model = hybrid
    rows = _row_caches(model, PROMPTS)
    batch = _batch(copy.deepcopy(rows))
    assert batch_rollback_supported(batch) is None
    verify = target.verify(mx.array(BLOCKS), batch, "wide")
    target.rollback_rows(batch, verify, kept)
    mx.eval([c.state for c in batch])

    chains = copy.deepcopy(rows)
    for chain, block, count in zip(chains, BLOCKS, kept, strict=True):
        for token in block[:count]:
            model(mx.array([[token]]), cache=chain)
    for row, chain in enumerate(chains):
        got, expected = _row_arrays(batch, row), _chain_arrays(chain)
        assert [a.shape for a in got] == [a.shape for a in expected]  # no hole, nothing stale: the same positions
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)

    # Decoding on from there: every row's next logits are its chain's, its RoPE positions included.
    after = model(mx.array([[7], [7], [7]]), cache=batch)
    for row, chain in enumerate(chains):
        np.testing.assert_allclose(np.array(after[row]), np.array(model(mx.array([[7]]), cache=chain)[0]),
                                   rtol=1e-4, atol=1e-4)


def test_a_kv_layer_rolls_only_what_a_row_rejected_beyond_the_others() -> None:
    layer = BatchKVCache([0, 0])
    keys = mx.arange(2 * 6, dtype=mx.float32).reshape(2, 1, 6, 1)
    layer.update_and_fetch(keys, keys)
    rollback_kv_rows([layer], [1, 3])  # row 0 drops its last 1, row 1 its last 3
    assert layer.size() == 5 and layer.left_padding.tolist() == [0, 2] and layer.offset.tolist() == [5, 3]
    k, _ = layer.keys_and_values()
    assert k[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4]
    assert k[1, 0, 2:, 0].tolist() == [6, 7, 8]  # its kept keys, right-justified; the front is padding


def test_the_fewest_rows_move_and_a_row_moves_forward_only_over_its_padding() -> None:
    assert fewest_moves([1, 3, 1, 2], [2, 0, 1, 0]) == 1  # two rows move back, as mlx-lm's right padding moves them
    assert fewest_moves([0, 1, 1, 1], [1, 0, 0, 0]) == 1  # the first row moves forward, alone
    assert fewest_moves([0, 1, 1, 1], [0, 0, 0, 0]) == 0  # ...but it has no padding to move over
    assert fewest_moves([0, 2, 2, 0], [2, 0, 0, 2]) == 0  # as many rows either way: the least trimmed
    layer = BatchKVCache([1, 0, 0])
    keys = mx.arange(3 * 5, dtype=mx.float32).reshape(3, 1, 5, 1)
    layer.update_and_fetch(keys, keys)
    rollback_kv_rows([layer], [0, 1, 1])  # the first row keeps the position the others reject
    assert layer.size() == 4 and layer.left_padding.tolist() == [0, 0, 0] and layer.offset.tolist() == [4, 4, 4]
    k, _ = layer.keys_and_values()
    assert k[:, 0, :, 0].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8], [10, 11, 12, 13]]


@pytest.mark.parametrize("seed", range(8))
def test_every_row_keeps_the_keys_and_offset_mlx_lms_right_padding_leaves_it(seed: int) -> None:
    """Whichever rows move, and which way: each row's unpadded keys and values, and its RoPE offset, are what
    mlx-lm's ``prepare(right_padding)``/``finalize`` leaves after trimming what every row rejected."""
    rng = np.random.default_rng(seed)
    rows = 5
    padding = [int(p) for p in rng.integers(0, 4, rows)]
    ours = BatchKVCache(padding)
    keys = mx.array(rng.standard_normal((rows, 2, int(rng.integers(6, 300)), 3)).astype(np.float32))
    ours.update_and_fetch(keys, keys + 1)
    theirs = BatchKVCache([0] * rows)
    theirs.keys, theirs.values = mx.array(ours.keys), mx.array(ours.values)
    theirs.offset, theirs.left_padding, theirs._idx = ours.offset, ours.left_padding, ours._idx
    rejected = [int(r) for r in rng.integers(0, 4, rows)]
    rollback_kv_rows([ours], rejected)
    theirs.trim(min(rejected))
    theirs.prepare(right_padding=[r - min(rejected) for r in rejected])
    theirs.finalize()
    assert ours.offset.tolist() == theirs.offset.tolist()
    for row in range(rows):
        mine, other = ours.extract(row), theirs.extract(row)
        assert mx.array_equal(mine.keys, other.keys).item() and mx.array_equal(mine.values, other.values).item()


def test_the_rows_rolled_back_are_the_bytes_mlx_lms_own_right_padding_gives() -> None:
    """Row by row, only the rows that move copied: against mlx-lm's ``prepare(right_padding)``/``finalize``
    (its ``dynamic_roll`` of the whole buffer) on the same layers, buffers longer than their index included."""
    rng = np.random.default_rng(0)

    def layers() -> list[BatchKVCache]:
        out = []
        for width in (5, 300):  # one buffer of its step's size, one over two steps long
            layer = BatchKVCache([2, 0, 1, 0])
            keys = mx.array(rng.standard_normal((4, 2, width, 3)).astype(np.float32))
            layer.update_and_fetch(keys, keys + 1)
            out.append(layer)
        return out

    ours = layers()
    theirs = [BatchKVCache([0] * 4) for _ in ours]
    for mine, other in zip(ours, theirs, strict=True):
        other.keys, other.values = mx.array(mine.keys), mx.array(mine.values)
        other.offset, other.left_padding, other._idx = mine.offset, mine.left_padding, mine._idx
    rejected = [1, 3, 1, 2]
    rollback_kv_rows(ours, rejected)
    for layer in theirs:
        layer.trim(1)
        layer.prepare(right_padding=[0, 2, 0, 1])
        layer.finalize()
    for mine, other in zip(ours, theirs, strict=True):
        for a, b in zip(mine.state, other.state, strict=True):
            assert (a == b) if isinstance(a, int) else mx.array_equal(a, b).item()


def test_a_cache_that_cannot_roll_back_by_row_says_so() -> None:
    from mlx_lm.models.cache import BatchRotatingKVCache

    assert "BatchRotatingKVCache" in (batch_rollback_supported([BatchRotatingKVCache(8, [0])]) or "")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    from mlxcel.checkpoints import inspect_checkpoint, load_checkpoint
    from mlxcel.families.gemma4.target import Gemma4Target
    from mlxcel.families.gemma4.tiny import build_target

    model, _ = load_checkpoint(inspect_checkpoint(build_target(tmp_path_factory.mktemp("batch-gemma") / "gemma4")))
    return Gemma4Target(model), model


@pytest.mark.parametrize("kept", [[1, 4, 2], [4, 4, 4], [3, 1, 4]])
def test_gemma_rows_roll_back_apart_past_the_window_and_the_ring(gemma: tuple[Any, Any], kept: list[int]) -> None:
    """Gemma 4's sliding-window rows (a ring of window + slack slots alone, a batch KV layer in the batch):
    rows inside the window, past the ring, and far past it, the batch's front dropped by the verify itself
    (a small growth step); each row then decodes as its single-token chain does, and comes back out of the
    batch as that chain's ring."""
    from mlxcel.families.gemma4.target import BatchWindowCache, SlidingWindowCache

    target, model = gemma
    prompts = [[3, 1, 4, 1, 5], [3 + (7 * i) % 90 for i in range(100)], [3 + (5 * i) % 91 for i in range(300)]]
    rows = _row_caches(model, prompts)
    batch = [type(layers[0]).merge(list(layers)) for layers in zip(*copy.deepcopy(rows), strict=True)]
    assert batch_rollback_supported(rows[0]) is None and batch_rollback_supported(batch) is None
    sliding = [layer for layer in batch if isinstance(layer, BatchWindowCache)]
    assert sliding and len(sliding) < len(batch)
    for layer in sliding:
        layer.step = 4
    width_before = sliding[0].size()
    verify = target.verify(mx.array(BLOCKS), batch, "wide")
    target.rollback_rows(batch, verify, kept)
    # The verify's block went in and the front as far went out: the batch holds what the window needs.
    assert sliding[0].size() == width_before - min(len(BLOCKS[0]) - k for k in kept)

    chains = copy.deepcopy(rows)
    for chain, block, count in zip(chains, BLOCKS, kept, strict=True):
        for token in block[:count]:
            model(mx.array([[token]]), cache=chain)
    for row, chain in enumerate(chains):
        for layer, own in zip(batch, chain, strict=True):
            out = layer.extract(row)
            assert type(out) is type(own) and out.offset == own.offset
            if isinstance(own, SlidingWindowCache):
                for a, b in zip(out.live_state()[:2], own.live_state()[:2], strict=True):
                    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5)
    for _ in range(3):  # decoding on: every row's logits are its chain's
        after = model(mx.array([[7], [7], [7]]), cache=batch)
        for row, chain in enumerate(chains):
            np.testing.assert_allclose(np.array(after[row]), np.array(model(mx.array([[7]]), cache=chain)[0]),
                                       rtol=1e-4, atol=1e-4)


def _labelled(positions: list[int]) -> Any:
    """Keys (1, 1, S, 1) whose values are their positions: what a cache holds is read off them."""
    return mx.array(positions, dtype=mx.float32).reshape(1, 1, -1, 1)


def test_a_window_batch_prefilled_in_right_padded_chunks_keeps_each_rows_own_keys() -> None:
    """Two prompts of 100 and 60 tokens prefilled together, the shorter right-padded: the chunk takes the batch
    past its bound, and its front is not dropped before the padding is rolled away, so each row comes back out
    with its own last positions (a pad key would read 1000 or more)."""
    from mlxcel.families.gemma4.target import SLACK, SlidingWindowCache

    window = 16
    batch = SlidingWindowCache.merge([SlidingWindowCache(window), SlidingWindowCache(window)])
    batch.step = 4
    batch.prepare(lengths=[100, 60], right_padding=[0, 40])
    chunk = mx.concatenate([_labelled(list(range(100))), _labelled([*range(60), *range(1000, 1040)])], axis=0)
    batch.update_and_fetch(chunk, chunk)
    batch.finalize()
    batch.update_and_fetch(_labelled([100, 60]).reshape(2, 1, 1, 1), _labelled([100, 60]).reshape(2, 1, 1, 1))
    for row, length in enumerate([101, 61]):
        held = batch.extract(row).temporal()
        assert held is not None
        expected = list(range(max(0, length - window - SLACK), length))
        assert np.array(held[0]).reshape(-1).tolist() == expected


def test_a_window_row_extracted_after_a_dropped_front_and_a_trim_is_its_chains_ring() -> None:
    """A row past the ring, the batch's front dropped by a block and the block then trimmed (every row rejected
    a draft): the row comes back out as the ring its single-token chain holds, slot for slot where it can see."""
    from mlxcel.families.gemma4.target import SlidingWindowCache

    window = 16
    alone = SlidingWindowCache(window)
    alone.update_and_fetch(_labelled(list(range(200))), _labelled(list(range(200))))
    chain = copy.deepcopy(alone)
    batch = SlidingWindowCache.merge([copy.deepcopy(alone)])
    batch.step = 4
    block = _labelled([200, 201, 202, 203])
    batch.update_and_fetch(block, block)  # past its bound: the front goes
    batch.trim(2)  # two drafts rejected
    for position in (200, 201):
        chain.update_and_fetch(_labelled([position]), _labelled([position]))
    out = batch.extract(0)
    assert out.offset == chain.offset == 202 and out.keys.shape == chain.keys.shape
    for a, b in zip(out.live_state()[:2], chain.live_state()[:2], strict=True):
        assert np.array(a).tolist() == np.array(b).tolist()
