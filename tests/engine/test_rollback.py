"""Rolling a hybrid target back after a verify, and the exactness probe that guards it."""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlxcel.engine.exactness import probe_exactness
from mlxcel.families.qwen3_5.target import Qwen35Target, _gated_delta_block
from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from mlxcel.models.row_exact import measure, rows_apart

pytestmark = pytest.mark.usefixtures("on_an_mlx_thread")  # the probe's rows verify runs on it

BLOCK = [5, 17, 99]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> tuple[Qwen35Target, Any]:
    path = build_mtp_checkpoint(tmp_path_factory.mktemp("rollback") / "qwen35", context_scale=1.0)
    model, _ = load(str(path))
    return Qwen35Target(model), model


def _arrays(cache: list[Any]) -> list[np.ndarray]:
    """Every layer's cache arrays: keys and values up to the offset, or conv and recurrent state."""
    arrays = []
    for c in cache:
        if c.is_trimmable():
            arrays += [np.array(c.keys[..., :c.offset, :]), np.array(c.values[..., :c.offset, :])]
        else:
            arrays += [np.array(a) for a in c.cache]
    return arrays


@pytest.mark.parametrize("kept", [1, 2, 3])
def test_a_rollback_lands_on_the_single_token_chain_state(hybrid: tuple[Qwen35Target, Any], kept: int) -> None:
    target, model = hybrid
    assert target.mixers  # the checkpoint is hybrid: there is recurrent state to roll back
    prompt = make_prompt_cache(model)
    model(mx.array([[3, 1, 4, 1, 5, 9, 2, 6]]), cache=prompt)
    mx.eval([c.state for c in prompt])

    verified = copy.deepcopy(prompt)
    measure(model, len(BLOCK))  # the products this BLAS multiplies otherwise in a block: a row at a time
    verify = target.verify(mx.array([BLOCK]), verified, "rows")
    target.rollback(verified, verify, kept=kept)
    chain = copy.deepcopy(prompt)
    for token in BLOCK[:kept]:
        model(mx.array([[token]]), cache=chain)

    for rolled_back, expected in zip(_arrays(verified), _arrays(chain), strict=True):
        assert rolled_back.shape == expected.shape and rolled_back.tobytes() == expected.tobytes()
    # And decoding on from there gives the chain's next logits, byte for byte.
    after_rollback = model(mx.array([[7]]), cache=verified)
    after_chain = model(mx.array([[7]]), cache=chain)
    assert np.array(after_rollback).tobytes() == np.array(after_chain).tobytes()


def test_the_adapter_gives_the_models_own_logits(hybrid: tuple[Qwen35Target, Any]) -> None:
    target, model = hybrid
    tokens = mx.array([[3, 1, 4, 1, 5]])
    logits, hidden = target.forward(tokens, make_prompt_cache(model))
    assert np.array(logits).tobytes() == np.array(model(tokens, cache=make_prompt_cache(model))).tobytes()
    assert hidden.shape == (1, 5, 64)


def test_the_probe_finds_an_exact_split(hybrid: tuple[Qwen35Target, Any]) -> None:
    # Which split is exact depends on this machine's BLAS (the matmul kernel it picks by row count);
    # that one of them is, for a K=3 block of this tiny model, holds for every BLAS seen so far.
    target, model = hybrid
    result = probe_exactness(target, model, lambda: make_prompt_cache(model), len(BLOCK), 512, 4096)
    assert result.split in ("wide", "rows", "half") and result.detail is None


class _OffByOneRollback:
    """A target whose rollback keeps one token too many of the recurrent state when two or more are dropped."""

    def __init__(self, inner: Qwen35Target) -> None:
        self.inner = inner

    def forward(self, tokens: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        return self.inner.forward(tokens, cache)

    def verify(self, tokens: mx.array, cache: list[Any], split: Any) -> Any:
        return self.inner.verify(tokens, cache, split)

    def rollback(self, cache: list[Any], verify: Any, kept: int) -> None:
        self.inner.rollback(cache, verify, kept)
        if verify.width - kept >= 2:  # only a deep rollback goes wrong, as a subtle bug would
            for (index, _), states in zip(self.inner.mixers, verify.states, strict=True):
                cache[index].cache = states[kept].cache_arrays()


class _WidthTwoDrift:
    """A target whose width-2 verify is off in the last bit of one logit, exact at every other width."""

    def __init__(self, inner: Qwen35Target) -> None:
        self.inner = inner
        self.forward = inner.forward
        self.rollback = inner.rollback

    def verify(self, tokens: mx.array, cache: list[Any], split: Any) -> Any:
        verify = self.inner.verify(tokens, cache, split)
        if tokens.shape[1] != 2:
            return verify
        logits = verify.logits
        bumped = logits.view(mx.int32) + (mx.arange(logits.shape[-1]) == 0).astype(mx.int32)
        return type(verify)(bumped.view(logits.dtype), verify.hidden, verify.width, verify.states)


class _Stepped:
    """What a verify returns here: logits of one single-token step per token, and the cache after each."""

    def __init__(self, logits: mx.array, after: list[list[Any]]) -> None:
        self.logits, self.after = logits, after


class _ChainTarget:
    """A target whose verify is the single-token chain itself, under every split: exact by construction
    on any machine's kernels (which shapes a real verify computes inexactly is the CPU's choice)."""

    def __init__(self, inner: Qwen35Target) -> None:
        self.forward = inner.forward

    def verify(self, tokens: mx.array, cache: list[Any], split: Any) -> _Stepped:
        logits, after = [], []
        for i in range(tokens.shape[1]):
            step, _ = self.forward(tokens[:, i:i + 1], cache)
            logits.append(step)
            after.append(copy.deepcopy(cache))
        return _Stepped(mx.concatenate(logits, axis=1), after)

    def rollback(self, cache: list[Any], verify: _Stepped, kept: int) -> None:
        cache[:] = copy.deepcopy(verify.after[kept - 1])


class _DeepDrift:
    """A target whose verify is off in the last bit of one logit: under the *deep* splits past 2,048 cached
    positions (as an attention that groups its sums by the cache's length could be), under the *shallow*
    ones at any length; exact otherwise (:class:`_ChainTarget`)."""

    def __init__(self, inner: Qwen35Target, deep: tuple[str, ...], shallow: tuple[str, ...] = ()) -> None:
        chain = _ChainTarget(inner)
        self.chain, self.deep, self.shallow = chain, deep, shallow
        self.forward, self.rollback = chain.forward, chain.rollback

    def verify(self, tokens: mx.array, cache: list[Any], split: Any) -> _Stepped:
        depth = next(c.offset for c in cache if hasattr(c, "offset"))
        verify = self.chain.verify(tokens, cache, split)
        if not (split in self.shallow or (depth >= 2048 and split in self.deep)):
            return verify
        logits = verify.logits
        bumped = logits.view(mx.int32) + (mx.arange(logits.shape[-1]) == 0).astype(mx.int32)
        return _Stepped(bumped.view(logits.dtype), verify.after)


def test_a_split_that_batches_the_attention_is_also_probed_deep(hybrid: tuple[Qwen35Target, Any]) -> None:
    target, model = hybrid
    fresh = lambda: make_prompt_cache(model)  # noqa: E731
    # half (the K queries attend together) exact at 12 and 1,024, off at depth: refused there.
    vetoed = probe_exactness(_DeepDrift(target, ("half",), shallow=("wide", "rows")), model, fresh, 3, 512, 4096)
    assert vetoed.split is None and vetoed.detail is not None
    assert "with half-width verify (the K-wide block in two forwards of at most ceil(K/2) tokens), a width-2 " \
           "verify at offset 4092: position 0 differs" in vetoed.detail
    # rows attends a query at a time, as each step does, at any length: it is not probed deep.
    chosen = probe_exactness(_DeepDrift(target, ("rows",), shallow=("wide", "half")), model, fresh, 3, 512, 4096)
    assert chosen.split == "rows"
    # and the chain itself is exact at every offset, the deep one included: the probe accepts it.
    assert probe_exactness(_ChainTarget(target), model, fresh, 3, 512, 4096).split == "wide"


def test_the_probe_checks_every_rollback_prefix_and_every_width(hybrid: tuple[Qwen35Target, Any]) -> None:
    target, model = hybrid
    wrong = probe_exactness(_OffByOneRollback(target), model, lambda: make_prompt_cache(model), 4, 512, 4096)
    assert wrong.split is None and wrong.detail is not None
    assert "rolled back to 1 kept token(s) differs from the single-token chain's cache state" in wrong.detail
    narrow = probe_exactness(_WidthTwoDrift(target), model, lambda: make_prompt_cache(model), 4, 512, 4096)
    assert narrow.split is None and narrow.detail is not None
    assert "a width-2 verify at offset 12: position 0 differs" in narrow.detail
    assert "with half-width verify" in narrow.detail  # the retry ran, and failed for its own reason


def test_at_k_two_the_probe_does_not_retry_the_same_computation(hybrid: tuple[Qwen35Target, Any]) -> None:
    # At K = 2 the half split is the single-token chain itself; the row split is another computation.
    target, model = hybrid
    vetoed = probe_exactness(_WidthTwoDrift(target), model, lambda: make_prompt_cache(model), 2, 512, 4096)
    assert vetoed.detail is not None and "half-width" not in vetoed.detail
    assert "; with row-split verify" in vetoed.detail


def test_both_recurrence_paths_give_the_chain_bytes(hybrid: tuple[Qwen35Target, Any]) -> None:
    # The CPU path shares mlx-lm's ops; the per-token path (used off the CPU, where mlx-lm
    # may pick a kernel for a single-token step) calls mlx-lm's own update once per token.
    target, model = hybrid
    index, mixer = target.mixers[0]
    prompt = make_prompt_cache(model)
    model(mx.array([[3, 1, 4, 1, 5, 9, 2, 6]]), cache=prompt)
    x = mx.random.normal((1, len(BLOCK), mixer.inner.hidden_size), key=mx.random.key(1))
    chain_cache = copy.deepcopy(prompt[index])
    chain = [np.array(mixer.inner(x[:, t:t + 1], None, chain_cache)) for t in range(len(BLOCK))]
    for per_token in (False, True):
        cache = copy.deepcopy(prompt[index])
        with rows_apart(model):  # the block's projections as a rows verify multiplies them: each row as its step
            out, states = _gated_delta_block(mixer.inner, x, cache, per_token=per_token)
        assert np.array(out).tobytes() == np.concatenate(chain, axis=1).tobytes()
        assert [np.array(a).tobytes() for a in cache.cache] == [np.array(a).tobytes() for a in chain_cache.cache]
        assert len(states) == len(BLOCK)


def test_the_probe_reads_bfloat16_logits(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = build_mtp_checkpoint(tmp_path_factory.mktemp("bf16") / "qwen35")
    model, _ = load(str(path))
    model.set_dtype(mx.bfloat16)
    result = probe_exactness(Qwen35Target(model), model, lambda: make_prompt_cache(model), 2, 512, 4096)
    assert result.split is not None and result.detail is None  # compared as bytes, not refused by numpy


def test_a_deep_starting_state_repeats_the_kv_rows_and_keeps_the_recurrent_state(
        hybrid: tuple[Qwen35Target, Any]) -> None:
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

    from mlxcel.engine.exactness import _repeated_to

    _, model = hybrid
    cache = make_prompt_cache(model)
    model(mx.array([list(range(3, 67))]), cache=cache)
    def recurrent() -> list[np.ndarray]:
        return [np.array(a) for _, a in tree_flatten([c.state for c in cache if isinstance(c, ArraysCache)])]

    before = recurrent()
    held = [(np.array(c.keys[..., :64, :]), np.array(c.values[..., :64, :])) for c in cache if type(c) is KVCache]
    assert held and before  # the hybrid has both kinds
    assert _repeated_to(cache, 300)
    grown = [c for c in cache if type(c) is KVCache]
    for c, (keys, values) in zip(grown, held, strict=True):
        assert c.offset == 300 and c.keys.shape[2] == 300
        np.testing.assert_array_equal(np.array(c.keys), np.concatenate([keys] * 5, axis=2)[..., :300, :])
        np.testing.assert_array_equal(np.array(c.values), np.concatenate([values] * 5, axis=2)[..., :300, :])
    assert all(np.array_equal(x, y) for x, y in zip(before, recurrent(), strict=True))
    # A step after it writes its key at the offset, as after a real prefill of 300 tokens.
    model(mx.array([[5]]), cache=cache)
    assert all(c.offset == 301 for c in grown)
    # A ring (a sliding window) is not grown: the caller prefills for real.
    ring = [RotatingKVCache(max_size=32), *make_prompt_cache(model)]
    model(mx.array([list(range(3, 67))]), cache=ring[1:])
    assert not _repeated_to(ring, 300)
    assert all(c.offset == 64 for c in ring[1:] if type(c) is KVCache)
