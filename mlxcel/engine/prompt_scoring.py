"""The prompt's own log-probabilities (completions ``echo`` with ``logprobs``): one forward over the prompt.

Each prompt token after the first is scored by the model's distribution after
the tokens before it, computed as classic decode computes its log-probabilities
(:func:`~mlxcel.engine.sampling.log_probabilities` of the model's own forward,
in float32). The prompt is fed through a fresh cache :data:`ROWS_PER_FORWARD`
tokens at a time, so at most that many rows of logits are alive, whatever the
prompt's length. Worker thread only.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .requests import PromptLogprobs
from .sampling import log_probabilities

ROWS_PER_FORWARD = 128
"""Prompt tokens per forward: 128 rows of float32 logits over a 256k vocabulary are 128 MiB."""


def score_prompt(model: Any, stream: Any, tokens: list[int], top: int, cache: list[Any]) -> PromptLogprobs:
    """The log-probability of ``tokens[1:]``, each after the tokens before it, with the *top* most likely
    (id, log-probability) per position, most likely first; *cache*: a fresh one of the model's."""
    values: list[float] = []
    tops: list[tuple[tuple[int, float], ...]] = []
    inputs = tokens[:-1]  # the last token predicts nothing of the prompt
    with mx.stream(stream):
        for start in range(0, len(inputs), ROWS_PER_FORWARD):
            chunk = inputs[start:start + ROWS_PER_FORWARD]
            targets = mx.array(tokens[start + 1:start + 1 + len(chunk)])
            logits = model(mx.array(chunk)[None], cache=cache)[0].astype(mx.float32)
            rows = log_probabilities(logits)
            chosen: list[float] = rows[mx.arange(len(chunk)), targets].tolist()  # type: ignore[assignment]
            values += chosen
            if top:
                ids = mx.argpartition(-rows, kth=top - 1, axis=-1)[:, :top]
                best = mx.take_along_axis(rows, ids, axis=-1)
                order = mx.argsort(-best, axis=-1)
                ranked: list[list[int]] = mx.take_along_axis(ids, order, axis=-1).tolist()  # type: ignore[assignment]
                scores: list[list[float]] = mx.take_along_axis(best, order, axis=-1).tolist()  # type: ignore[assignment]
                tops += [tuple(zip(i, v, strict=True)) for i, v in zip(ranked, scores, strict=True)]
    return PromptLogprobs(tuple(values), tuple(tops) if top else None)
