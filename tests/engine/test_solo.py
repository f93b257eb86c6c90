"""The solo decoder's edge cases, on a tiny hybrid checkpoint with an MTP head."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from mlxcel.checkpoints import inspect_checkpoint, load_drafter, speculative_target
from mlxcel.engine.burst import Burst
from mlxcel.engine.solo import SoloDecoder
from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from mlxcel.models.drafters import DrafterSpec
from mlxcel.models.speculative import DraftHead


@pytest.fixture(scope="module")
def pairing(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, DraftHead]:
    path = build_mtp_checkpoint(tmp_path_factory.mktemp("solo") / "qwen35", drafter="aligned", context_scale=0.0)
    model, _ = load(str(path))
    spec = DrafterSpec(path=path, name="qwen35#mtp", in_checkpoint=True, model_type="qwen3_5")
    return model, load_drafter(spec, inspect_checkpoint(path), model)


def _greedy(model: Any, prompt: list[int], count: int) -> list[int]:
    """The independent oracle: the model's own forward, one token at a time."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    tokens = [int(mx.argmax(logits[0, -1]).item())]
    for _ in range(count - 1):
        logits = model(mx.array([tokens[-1:]]), cache=cache)
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
    return tokens


def test_a_round_with_the_whole_prompt_cached_starts_with_a_classic_step(pairing: tuple[Any, DraftHead]) -> None:
    model, head = pairing
    prompt = [5, 17, 99, 123, 7, 8]
    stream = mx.default_stream(mx.default_device())
    # The prefix cache covered all but the last prompt token: nothing left to prefill, no hidden state yet.
    cache = make_prompt_cache(model)
    model(mx.array([prompt[:-1]]), cache=cache)
    burst = Burst(speculative_target("qwen3_5", model), head.new_sequence(cache), "half", None)
    solo = SoloDecoder(model, stream, None, cache, prompt[:-1], prompt[-1:], burst)
    assert solo.prefilled and not solo.can_draft  # so the burst starts with a classic step
    first: list[int] = []
    assert not solo.classic_steps(1, False, lambda token: first.append(token) is not None)
    assert solo.can_draft  # which gave the head its state
    solo.start_round(4)
    second = solo.finish_round()
    assert burst.stats.rounds == 1 and len(second) == 4  # the aligned head: every draft accepted
    assert first + second == _greedy(model, prompt, 5)


def test_prefill_goes_chunk_by_chunk_and_the_head_catches_up_with_it(pairing: tuple[Any, DraftHead]) -> None:
    model, head = pairing
    prompt = [(7 * i) % 500 + 3 for i in range(23)]
    cache = make_prompt_cache(model)
    burst = Burst(speculative_target("qwen3_5", model), head.new_sequence(cache), "half", None)
    solo = SoloDecoder(model, mx.default_stream(mx.default_device()), None, cache, [], list(prompt), burst)
    chunks = 0
    while not solo.prefilled:
        solo.prefill_chunk(5)
        chunks += 1
        assert len(solo.tokens_in_cache) == min(5 * chunks, len(prompt) - 1)
    assert chunks == 5 and solo.next_input == prompt[-1] and solo.can_draft
    tokens: list[int] = []
    assert not solo.classic_steps(3, True, lambda token: tokens.append(token) is not None)
    while len(tokens) < 12:
        solo.start_round(3)
        tokens += solo.finish_round()
    assert tokens[:12] == _greedy(model, prompt, 12)
    assert burst.stats.classic_samples == 1 and burst.stats.classic_steps == 3


def test_classic_steps_without_a_drafter_are_the_models_own_forward(pairing: tuple[Any, DraftHead]) -> None:
    model, _ = pairing
    prompt = [11, 12, 13, 14]
    solo = SoloDecoder(model, mx.default_stream(mx.default_device()), None, make_prompt_cache(model), [],
                       list(prompt))
    solo.prefill_chunk(512)
    tokens: list[int] = []
    assert not solo.classic_steps(6, False, lambda token: tokens.append(token) is not None)
    assert tokens == _greedy(model, prompt, 6)
    assert solo.parked and solo.tokens_in_cache == prompt + solo.tokens_in_cache[len(prompt):]
