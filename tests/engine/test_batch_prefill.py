"""The continuous batch prefills each waiting prompt alone, all of them in a step: a prompt's cache (and every
token after it) is the same bytes whichever prompts arrived beside it, and prompts arriving together do not
wait for each other's prefill a step each."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from mlxcel.engine.batch import ContinuousBatch
from mlxcel.models.row_exact import measure_steps
from mlxcel.testing.checkpoints import build_checkpoint

pytestmark = pytest.mark.usefixtures("on_an_mlx_thread")

PROMPTS = [[1, 5, 9, 13], [2, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [9, 9, 1], [40, 41, 42, 43, 44, 45]]
TOKENS = 6


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    model, _ = load(str(build_checkpoint(tmp_path_factory.mktemp("prefill") / "llama", "llama")))
    measure_steps(model, 5)  # as the server does at load for its batch: a row's step, the same bytes at any width
    return model


def _served(model: Any, prompts: list[list[int]]) -> tuple[list[list[tuple[int, bytes]]], list[int]]:
    """Each prompt's (token, log-probabilities' bytes) in order, and the step at which its first token came,
    all inserted at once into a batch of 4 places (and the overflow place)."""
    batch: ContinuousBatch[int] = ContinuousBatch(model, frozenset(), 4, 512, mx.default_stream(mx.default_device()))
    for i, prompt in enumerate(prompts):
        batch.insert(i, prompt, None, [], TOKENS, None, [])
    out: list[list[tuple[int, bytes]]] = [[] for _ in prompts]
    first = [-1] * len(prompts)
    for step in range(4 * TOKENS):
        for i, response in batch.step().tokens:
            first[i] = step if first[i] < 0 else first[i]
            out[i].append((response.token, np.array(response.logprobs).tobytes()))
        if all(len(tokens) == TOKENS for tokens in out):
            break
    batch.close()
    return out, first


def test_prompts_arriving_together_are_each_prefilled_alone_in_one_step(model: Any) -> None:
    together, first = _served(model, PROMPTS)
    alone = [_served(model, [prompt]) for prompt in PROMPTS]
    assert together == [tokens[0] for tokens, _ in alone]  # tokens and log-probabilities, byte for byte
    # No prompt waits a step for each prompt before it (a prompt batch of one, a prompt a step: first tokens at
    # steps 2, 4, 6, 8, 10); the last, in the overflow place, within two steps of a prompt alone.
    assert max(first) <= max(steps[0] for _, steps in alone) + 2
    assert len({tuple(t for t, _ in tokens) for tokens in together}) > 1  # the prompts did differ


def test_prompts_the_prefix_cache_held_take_their_first_step_together(model: Any) -> None:
    # Only the last token left (the rest cached): one step of several rows, one position each, is the same bytes
    # as each alone, so they are admitted together: one forward for all, not one each.
    from mlx_lm.models.cache import make_prompt_cache

    def cached(prompt: list[int]) -> list[Any]:
        cache = make_prompt_cache(model)
        model(mx.array([prompt[:-1]]), cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    class Counted:  # the model, its forwards counted
        def __init__(self) -> None:
            self.forwards = 0

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            self.forwards += 1
            return model(*args, **kwargs)

        def __getattr__(self, name: str) -> Any:
            return getattr(model, name)

    def served(prompts: list[list[int]]) -> tuple[list[list[tuple[int, bytes]]], int]:
        counted = Counted()
        batch: ContinuousBatch[int] = ContinuousBatch(counted, frozenset(), 4, 512,
                                                      mx.default_stream(mx.default_device()))
        for i, prompt in enumerate(prompts):
            batch.insert(i, prompt[-1:], cached(prompt), prompt[:-1], TOKENS, None, [])
        out: list[list[tuple[int, bytes]]] = [[] for _ in prompts]
        while not all(len(tokens) == TOKENS for tokens in out):
            for i, response in batch.step().tokens:
                out[i].append((response.token, np.array(response.logprobs).tobytes()))
        batch.close()
        return out, counted.forwards

    prompts = PROMPTS[:4]
    together, forwards = served(prompts)
    alone = [served([prompt]) for prompt in prompts]
    assert together == [tokens[0] for tokens, _ in alone]
    assert forwards == alone[0][1]  # as many forwards for the four as for one: their first step together
