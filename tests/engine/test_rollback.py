"""Rolling a hybrid target back after a verify: every kept prefix lands on the chain's exact state."""

from __future__ import annotations

import copy

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlxcel.engine.mtp import TargetModel, _gated_delta_block, probe_exactness
from tests.checkpoints import build_mtp_checkpoint

BLOCK = [5, 17, 99]  # K = 3: one wide verify is exact with every BLAS here


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> tuple[TargetModel, object]:
    path = build_mtp_checkpoint(tmp_path_factory.mktemp("rollback") / "qwen35", context_scale=1.0)
    model, _ = load(str(path))
    return TargetModel(model), model


def _arrays(cache: list[object]) -> list[np.ndarray]:
    """Every layer's cache arrays: keys and values up to the offset, or conv and recurrent state."""
    arrays = []
    for c in cache:
        if c.is_trimmable():  # type: ignore[attr-defined]
            arrays += [np.array(c.keys[..., :c.offset, :]), np.array(c.values[..., :c.offset, :])]  # type: ignore[attr-defined]
        else:
            arrays += [np.array(a) for a in c.cache]  # type: ignore[attr-defined]
    return arrays


@pytest.mark.parametrize("kept", [1, 2, 3])
def test_a_rollback_lands_on_the_single_token_chain_state(hybrid: tuple[TargetModel, object], kept: int) -> None:
    target, model = hybrid
    assert target.mixers  # the checkpoint is hybrid: there is recurrent state to roll back
    prompt = make_prompt_cache(model)
    target.forward(mx.array([[3, 1, 4, 1, 5, 9, 2, 6]]), prompt)
    mx.eval([c.state for c in prompt])

    verified = copy.deepcopy(prompt)
    _, _, states = target.verify(mx.array([BLOCK]), verified, "wide")
    target.rollback(verified, states, kept=kept, dropped=len(BLOCK) - kept)
    chain = copy.deepcopy(prompt)
    for token in BLOCK[:kept]:
        target.forward(mx.array([[token]]), chain)

    for rolled_back, expected in zip(_arrays(verified), _arrays(chain), strict=True):
        assert rolled_back.shape == expected.shape and rolled_back.tobytes() == expected.tobytes()
    # And decoding on from there gives the chain's next logits, byte for byte.
    after_rollback, _ = target.forward(mx.array([[7]]), verified)
    after_chain, _ = target.forward(mx.array([[7]]), chain)
    assert np.array(after_rollback).tobytes() == np.array(after_chain).tobytes()


def test_the_probe_accepts_the_snapshotting_verify(hybrid: tuple[TargetModel, object]) -> None:
    target, model = hybrid
    result = probe_exactness(target, lambda: make_prompt_cache(model), len(BLOCK), vocab=512)
    assert (result.selection, result.detail) == ("wide", None)


def test_both_recurrence_paths_give_the_chain_bytes(hybrid: tuple[TargetModel, object]) -> None:
    # The CPU path shares mlx-lm's ops; the per-token path (used off the CPU, where mlx-lm
    # may pick a kernel for a single-token step) calls mlx-lm's own update once per token.
    target, model = hybrid
    index, mixer = target.mixers[0]
    prompt = make_prompt_cache(model)
    target.forward(mx.array([[3, 1, 4, 1, 5, 9, 2, 6]]), prompt)
    x = mx.random.normal((1, len(BLOCK), mixer.inner.hidden_size), key=mx.random.key(1))
    chain_cache = copy.deepcopy(prompt[index])
    chain = [np.array(mixer.inner(x[:, t:t + 1], None, chain_cache)) for t in range(len(BLOCK))]
    for per_token in (False, True):
        cache = copy.deepcopy(prompt[index])
        out, states = _gated_delta_block(mixer.inner, x, cache, per_token=per_token)
        assert np.array(out).tobytes() == np.concatenate(chain, axis=1).tobytes()
        assert [np.array(a).tobytes() for a in cache.cache] == [np.array(a).tobytes() for a in chain_cache.cache]
        assert len(states) == len(BLOCK)


def test_the_probe_reads_bfloat16_logits(tmp_path_factory: pytest.TempPathFactory) -> None:
    path = build_mtp_checkpoint(tmp_path_factory.mktemp("bf16") / "qwen35")
    model, _ = load(str(path))
    model.set_dtype(mx.bfloat16)
    result = probe_exactness(TargetModel(model), lambda: make_prompt_cache(model), len(BLOCK), vocab=512)
    assert (result.selection, result.detail) == ("wide", None)  # compared as bytes, not refused by numpy
