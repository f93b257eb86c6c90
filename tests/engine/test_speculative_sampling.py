"""The temperature > 0 acceptance rule leaves the target's output distribution unchanged."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.engine.mtp import SpeculativeSampler

TRIALS = 4000


def _run(logits: mx.array, drafts: list[int], sampler: SpeculativeSampler) -> list[tuple[int, int]]:
    return [sampler(logits, drafts) for _ in range(TRIALS)]


@pytest.mark.parametrize(("temperature", "top_k"), [(1.0, 0), (0.7, 0), (1.0, 3)])
def test_first_token_and_second_given_first_follow_the_target(temperature: float, top_k: int) -> None:
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(size=(3, 6)).astype(np.float32) * 1.5)  # K = 3 positions, vocab 6
    drafts = [2, 4]
    sampler = SpeculativeSampler(temperature, 1.0, top_k, seed=1)
    target = np.array(sampler.distribution(logits))
    results = _run(logits, drafts, sampler)

    # First emitted token: the draft when its first draft is accepted, else the sampled token.
    first = np.array([drafts[0] if accepted >= 1 else token for accepted, token in results])
    observed = np.bincount(first, minlength=6) / TRIALS
    np.testing.assert_allclose(observed, target[0], atol=0.03)

    # Second token, given the first was the draft (its context in the verify block).
    given = [(drafts[1] if accepted >= 2 else token) for accepted, token in results if accepted >= 1]
    observed = np.bincount(np.array(given), minlength=6) / len(given)
    np.testing.assert_allclose(observed, target[1], atol=0.04)
    # Top-k keeps the sampled tokens among the k most likely.
    if top_k:
        assert set(first) <= set(np.argsort(-target[0])[:top_k])


def test_seeded_sampling_is_reproducible() -> None:
    logits = mx.array(np.random.default_rng(1).normal(size=(4, 8)).astype(np.float32))
    runs = [[SpeculativeSampler(1.0, 1.0, 0, seed=5)(logits, [1, 2, 3]) for _ in range(1)] for _ in range(2)]
    assert runs[0] == runs[1]
