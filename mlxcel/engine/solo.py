"""A sequence decoding alone: no batching machinery between it and the model.

When one request is all the worker has, it decodes it here, one pipelined
step at a time (the next step is queued on the device before the current token
is read back, as mlx-lm's ``generate_step`` does). When another request
arrives the worker *parks* the sequence (stops feeding it, so exactly one
token, the next input, is left unfed) and hands its cache and that token to the
continuous batcher, which carries on from the same state.

Runs on the worker thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Sampler = Callable[[Any], Any]


class SoloDecoder:
    """One sequence's cache and its pipelined decode steps.

    Invariant while parked: ``cache`` holds exactly ``tokens_in_cache`` and
    ``next_input`` is the one token still to feed. While running, one step
    (the model fed the last emitted token) is in flight.
    """

    def __init__(self, model: Any, stream: Any, sampler: Sampler | None, cache: list[Any],
                 tokens_in_cache: list[int], next_input: int) -> None:
        from mlx_lm.sample_utils import greedy_sampler

        self.model = model
        self.stream = stream
        self.sampler: Sampler = sampler or greedy_sampler
        self.cache = cache
        self.tokens_in_cache = tokens_in_cache
        self.next_input = next_input
        self._in_flight: tuple[Any, Any] | None = None

    @classmethod
    def prefill(cls, model: Any, stream: Any, sampler: Sampler | None, cache: list[Any] | None,
                cached_tokens: list[int], rest: list[int], step_size: int) -> SoloDecoder:
        """Feed *rest* but its last token into *cache* (a fresh one when None), in chunks."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        cache = cache if cache is not None else make_prompt_cache(model)
        with mx.stream(stream):
            for start in range(0, len(rest) - 1, step_size):
                chunk = rest[start:min(start + step_size, len(rest) - 1)]
                model(mx.array(chunk)[None], cache=cache)
                mx.eval([c.state for c in cache])
        return cls(model, stream, sampler, cache, cached_tokens + rest[:-1], rest[-1])

    @property
    def parked(self) -> bool:
        return self._in_flight is None

    def _feed(self, token: Any) -> tuple[Any, Any]:
        import mlx.core as mx

        with mx.stream(self.stream):
            logits = self.model(token.reshape(1, 1), cache=self.cache)[:, -1, :]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            sampled = self.sampler(logprobs)
        mx.async_eval(sampled, logprobs)
        return sampled, logprobs

    def resume(self) -> None:
        """Start decoding from the parked state: feed ``next_input``."""
        import mlx.core as mx

        assert self.parked
        self._in_flight = self._feed(mx.array([self.next_input]))
        self.tokens_in_cache.append(self.next_input)

    def emit(self, feed_next: bool) -> tuple[int, Any]:
        """The next token and its log-probabilities (shape ``(1, vocab)``).

        With *feed_next*, the token is fed straight away (the following step
        runs while the caller handles this one); without it the decoder parks
        with this token as ``next_input``.
        """
        assert self._in_flight is not None
        sampled, logprobs = self._in_flight
        self._in_flight = self._feed(sampled) if feed_next else None
        token = int(sampled.item())
        if feed_next:
            self.tokens_in_cache.append(token)
        else:
            self.next_input = token
        return token, logprobs
