"""The prompt's own log-probabilities (completions ``echo`` with ``logprobs``), a chunk per turn.

Each prompt token after the first is scored by the model's distribution after
the tokens before it, computed as classic decode computes its log-probabilities
(:func:`~mlxcel.engine.sampling.log_probabilities` of the model's own forward,
in float32). The prompt is fed through a fresh cache :data:`ROWS_PER_FORWARD`
tokens at a time, one chunk per :meth:`PromptScorer.step`: the worker takes one
step per scoring turn, between the batch's steps, so a long prompt's scores
never pause the other streams for longer than one chunk, and at most that many
rows of logits are alive, whatever the prompt's length. Worker thread only.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from .requests import PromptLogprobs
from .sampling import log_probabilities

ROWS_PER_FORWARD = 128
"""Prompt tokens per forward: 128 rows of float32 logits over a 256k vocabulary are 128 MiB."""


class PromptScorer:
    """Scores ``tokens[1:]``, each after the tokens before it, with the *top* most likely (id,
    log-probability) per position, most likely first. *cache*: a fresh one of the model's; once the scores
    are whole it holds ``tokens[:-1]``, the prompt's prefill but its last token, as classic decode's."""

    def __init__(self, model: Any, stream: Any, tokens: list[int], top: int, cache: list[Any]) -> None:
        self._model, self._stream, self._top, self._cache = model, stream, top, cache
        self._tokens = tokens
        self._done = 0  # inputs fed: the last token predicts nothing of the prompt, so len(tokens) - 1 in all
        self._values: list[float] = []
        self._tops: list[tuple[tuple[int, float], ...]] = []

    def step(self) -> PromptLogprobs | None:
        """Score the next :data:`ROWS_PER_FORWARD` positions; the whole prompt's scores once the last is done."""
        start = self._done
        chunk = self._tokens[start:min(start + ROWS_PER_FORWARD, len(self._tokens) - 1)]
        if chunk:
            with mx.stream(self._stream):
                self._score(chunk, mx.array(self._tokens[start + 1:start + 1 + len(chunk)]))
            self._done += len(chunk)
        if self._done < len(self._tokens) - 1:
            return None
        return PromptLogprobs(tuple(self._values), tuple(self._tops) if self._top else None)

    def _score(self, chunk: list[int], targets: mx.array) -> None:
        top = self._top
        rows = log_probabilities(self._model(mx.array(chunk)[None], cache=self._cache)[0].astype(mx.float32))
        chosen: list[float] = rows[mx.arange(len(chunk)), targets].tolist()  # type: ignore[assignment]
        self._values += chosen
        if top:
            ids = mx.argpartition(-rows, kth=top - 1, axis=-1)[:, :top]
            best = mx.take_along_axis(rows, ids, axis=-1)
            order = mx.argsort(-best, axis=-1)
            ranked: list[list[int]] = mx.take_along_axis(ids, order, axis=-1).tolist()  # type: ignore[assignment]
            scores: list[list[float]] = mx.take_along_axis(best, order, axis=-1).tolist()  # type: ignore[assignment]
            self._tops += [tuple(zip(i, v, strict=True)) for i, v in zip(ranked, scores, strict=True)]
