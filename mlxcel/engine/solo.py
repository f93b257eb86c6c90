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

import time
from collections.abc import Callable
from typing import Any

from .mtp import Drafter, PendingRound, Selection, SpeculativeSampler, TargetModel, finish_round, start_round
from .requests import BurstStats

Sampler = Callable[[Any], Any]


class SoloDecoder:
    """One sequence's cache and its pipelined decode steps.

    Invariant while parked: ``cache`` holds exactly ``tokens_in_cache`` and
    ``next_input`` is the one token still to feed. While running, one step
    (the model fed the last emitted token) or one speculative round is in
    flight, and those two fields catch up when it is read back.
    """

    def __init__(self, target: TargetModel, stream: Any, sampler: Sampler | None, cache: list[Any],
                 tokens_in_cache: list[int], next_input: int, drafter: Drafter | None = None) -> None:
        from mlx_lm.sample_utils import greedy_sampler

        self.target = target
        self.drafter = drafter
        self.stream = stream
        self.sampler: Sampler = sampler or greedy_sampler
        self.cache = cache
        self.tokens_in_cache = tokens_in_cache
        self.next_input = next_input
        self._in_flight: tuple[Any, Any] | None = None
        self._round: PendingRound | None = None

    @classmethod
    def prefill(cls, target: TargetModel, stream: Any, sampler: Sampler | None, cache: list[Any],
                cached_tokens: list[int], rest: list[int], step_size: int,
                drafter: Drafter | None = None) -> SoloDecoder:
        """Feed *rest* but its last token into *cache*, in chunks (the drafter sees them too)."""
        import mlx.core as mx

        with mx.stream(stream):
            for start in range(0, len(rest) - 1, step_size):
                end = min(start + step_size, len(rest) - 1)
                _, hidden = target.forward(mx.array(rest[start:end])[None], cache)
                if drafter is not None:
                    drafter.add(hidden, mx.array(rest[start + 1:end + 1])[None])
                mx.eval([c.state for c in cache])
        return cls(target, stream, sampler, cache, cached_tokens + rest[:-1], rest[-1], drafter)

    @property
    def parked(self) -> bool:
        return self._in_flight is None and self._round is None

    @property
    def round_in_flight(self) -> bool:
        return self._round is not None

    @property
    def can_draft(self) -> bool:
        """Whether the head has a target hidden state to draft from (not when the prompt came
        whole from the prefix cache: then a classic step provides one)."""
        return self.drafter is not None and bool(self.drafter.pending_hidden)

    def _feed(self, token: Any) -> tuple[Any, Any]:
        import mlx.core as mx

        with mx.stream(self.stream):
            logits, hidden = self.target.forward(token.reshape(1, 1), self.cache)
            logits = logits[:, -1, :]
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            sampled = self.sampler(logprobs)
            if self.drafter is not None:
                self.drafter.add(hidden, sampled.reshape(1, 1))
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

    def classic_step(self) -> tuple[int, Any, float]:
        """One unpipelined single-token step from the parked state: (token, logprobs, seconds)."""
        started = time.perf_counter()
        self.resume()
        token, logprobs = self.emit(feed_next=False)
        return token, logprobs, time.perf_counter() - started

    def start_round(self, width: int, selection: Selection) -> None:
        """Dispatch one speculative round of verify width *width* from the parked state."""
        import mlx.core as mx

        assert self.parked and self.can_draft and self.drafter is not None
        with mx.stream(self.stream):
            self._round = start_round(self.target, self.cache, self.drafter, self.next_input, width, selection)

    def finish_round(self, stats: BurstStats | None, sampler: SpeculativeSampler | None = None) -> list[int]:
        """Read back the round in flight and park; the tokens it emits (1 to its width)."""
        import mlx.core as mx

        assert self._round is not None and self.drafter is not None
        with mx.stream(self.stream):
            fed, emitted = finish_round(self._round, self.target, self.cache, self.drafter, stats, sampler)
        self._round = None
        self.tokens_in_cache.extend(fed)
        self.next_input = emitted[-1]
        return emitted
