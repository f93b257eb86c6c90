"""A sequence decoding alone: no batching machinery between it and the model.

When one request is all the worker has, it decodes it here: its prompt in
chunks (one chunk per call, so the worker looks at its inbox between chunks),
then one pipelined step at a time (the next step is queued on the device
before the current token is read back, as mlx-lm's ``generate_step`` does), or
MTP rounds (:mod:`.burst`). Classic steps call the model itself,
``model(tokens, cache=cache)``: the family's own forward, with its logit
soft-capping or scaling. When another request arrives the worker *parks* the
sequence (nothing in flight; ``pending`` holds the tokens still to feed, the
last of them the next input) and hands its cache and those tokens to the
continuous batcher, which carries on from the same state.

Runs on the worker thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from ..models.speculative import SETTLE_EVERY
from .burst import Burst, PendingRound
from .instrument import Probe
from .sampling import log_probabilities

Sampler = Callable[[Any], Any]
Processor = Callable[[Any, Any], Any]
"""mlx-lm's logits processor: ``processor(tokens, logits) -> logits``."""


class SoloDecoder:
    """One sequence's cache and its steps.

    Invariant while parked: ``cache`` holds exactly ``tokens_in_cache``, and
    ``pending`` (never empty) the tokens still to feed. Prefilled: exactly one
    pending token, the next input. While running, one step (the model fed the
    last emitted token) or one round is in flight, and those fields catch up
    when it is read back.
    """

    def __init__(self, model: Any, stream: Any, sampler: Sampler | None, cache: list[Any],
                 tokens_in_cache: list[int], pending: list[int], burst: Burst | None = None,
                 probe: Probe | None = None, processors: Sequence[Processor] = ()) -> None:
        from mlx_lm.sample_utils import greedy_sampler

        assert pending, "a sequence always has its next input to feed"
        self.model = model
        self.burst = burst
        self.stream = stream
        self.sampler: Sampler = sampler or greedy_sampler
        self.cache = cache
        self.tokens_in_cache = tokens_in_cache
        self.pending = pending
        self._probe = probe
        self.processors = tuple(processors)
        """Applied by classic steps; the burst, if any, applies the same ones at every verify position."""
        self._context: Any = None  # every token fed so far, on the device: what the processors read
        self._in_flight: tuple[Any, Any] | None = None
        self._round: PendingRound | None = None
        self._unsettled = 0  # classic steps the drafter has queued and not read (read every SETTLE_EVERY)

    # -- state --------------------------------------------------------------------

    @property
    def parked(self) -> bool:
        return self._in_flight is None and self._round is None

    @property
    def prefilled(self) -> bool:
        return len(self.pending) == 1

    @property
    def next_input(self) -> int:
        assert self.prefilled
        return self.pending[0]

    @property
    def round_in_flight(self) -> bool:
        return self._round is not None

    @property
    def can_draft(self) -> bool:
        """Whether the drafter has a target hidden state to draft from (not when the prompt came
        whole from the prefix cache: then a classic step provides one)."""
        return self.burst is not None and self.burst.drafter.ready

    # -- prefill ------------------------------------------------------------------

    def prefill_chunk(self, size: int) -> None:
        """Feed up to *size* of the pending prompt tokens (all but the last), and wait for them."""
        assert self.parked and not self.prefilled
        chunk, rest = self.pending[:min(size, len(self.pending) - 1)], self.pending[min(size, len(self.pending) - 1):]
        with mx.stream(self.stream):
            tokens = mx.array([chunk])
            if self.burst is None:
                self.model(tokens, cache=self.cache)
                wait: list[Any] = []
            else:  # the drafter catches up on the same chunk, never on the whole prompt at once
                _, hidden = self.burst.target.forward(tokens, self.cache)
                self.burst.drafter.catch_up(hidden, mx.array([[*chunk[1:], rest[0]]]))
                wait = self.burst.drafter.settle()
            mx.eval(wait + [c.state for c in self.cache])
        self.tokens_in_cache.extend(chunk)
        self.pending = rest

    # -- classic steps ------------------------------------------------------------------

    def _feed(self, token: Any) -> tuple[Any, Any]:
        if self._probe is not None:
            self._probe("solo_step")
        with mx.stream(self.stream):
            tokens = token.reshape(1, 1)
            if self.burst is None:
                logits = self.model(tokens, cache=self.cache)[:, -1, :]
                hidden = None
            else:
                logits, hidden = self.burst.target.forward(tokens, self.cache)
                logits = logits[:, -1, :]
            if self.processors:  # as mlx-lm: on the logits, with every token so far, the input included
                before = (mx.array(self.tokens_in_cache, dtype=mx.int32) if self._context is None
                          else self._context)
                self._context = mx.concatenate([before, tokens.reshape(-1).astype(mx.int32)])
                for processor in self.processors:
                    logits = processor(self._context, logits)
            logprobs = log_probabilities(logits)
            sampled = self.sampler(logprobs)
            settled: list[Any] = []
            if hidden is not None:
                assert self.burst is not None
                self.burst.drafter.catch_up(hidden, sampled.reshape(1, 1))
                self._unsettled += 1
                if self._unsettled >= SETTLE_EVERY:  # a long classic stretch (the rule parked the burst)
                    settled, self._unsettled = self.burst.drafter.settle(), 0
        mx.async_eval(sampled, logprobs, *settled, *([self._context] if self.processors else []))
        return sampled, logprobs

    def resume(self) -> None:
        """Start decoding from the parked, prefilled state: feed the next input."""
        assert self.parked and self.prefilled
        token = self.pending[0]
        self._in_flight = self._feed(mx.array([token]))
        self.tokens_in_cache.append(token)
        self.pending = []

    def emit(self, feed_next: bool) -> tuple[int, Any]:
        """The next token and its log-probabilities (shape ``(1, vocab)``).

        With *feed_next*, the token is fed straight away (the following step
        runs while the caller handles this one); without it the decoder parks
        with this token as the next input.
        """
        assert self._in_flight is not None
        sampled, logprobs = self._in_flight
        self._in_flight = self._feed(sampled) if feed_next else None
        token = int(sampled.item())
        if feed_next:
            self.tokens_in_cache.append(token)
        else:
            self.pending = [token]
        return token, logprobs

    def classic_steps(self, count: int, timed: bool, handle: Callable[[int], bool]) -> bool:
        """Up to *count* pipelined classic steps from the parked state; True if *handle* finished the sequence.

        Each token goes to *handle* as soon as it is read back, while the next
        step runs, exactly as classic decode handles its tokens. *timed*: the
        time of the *count* steps, from the first dispatch to the last token
        handled, goes into the burst's statistics as one classic sample. (Not
        from the first token read back: MLX's read-back waits for the whole
        stream on some backends, the step queued behind included, so intervals
        between read-backs do not count steps reliably; the span from the
        first dispatch always holds exactly *count* of them.)
        """
        started = time.perf_counter()
        finished, _ = self.classic_run(lambda read: read < count, handle)
        if not finished and timed and self.burst is not None:
            stats = self.burst.stats
            stats.classic_steps += count
            stats.classic_seconds += time.perf_counter() - started
            stats.classic_samples += 1
        return finished

    def classic_run(self, more: Callable[[int], bool], handle: Callable[[int], bool]) -> tuple[bool, int]:
        """Pipelined classic steps from the parked state, each token to *handle* as it is read back: before
        the n-th token is read, *more(n)* says whether the step after it is fed now (else the run ends there,
        parked). (Whether *handle* finished the sequence, the tokens read.)"""
        self.resume()
        read = 0
        while True:
            read += 1
            feed = more(read)
            token, _ = self.emit(feed_next=feed)
            if handle(token):
                return True, read  # a step may still be in flight: the sequence is done with this cache
            if not feed:
                return False, read

    # -- rounds ---------------------------------------------------------------------

    def start_round(self, width: int) -> None:
        """Dispatch one speculative round of verify width *width* from the parked state."""
        assert self.parked and self.can_draft and self.burst is not None
        with mx.stream(self.stream):
            self._round = self.burst.start_round(self.cache, self.next_input, width, self.tokens_in_cache)

    def finish_round(self, count: bool = True) -> list[int]:
        """Read back the round in flight and park; the tokens it emits (1 to its width)."""
        assert self._round is not None and self.burst is not None
        with mx.stream(self.stream):
            fed, emitted = self.burst.finish_round(self._round, self.cache, count)
        self._round = None
        self._unsettled = 0  # the round's draft read everything queued
        self.tokens_in_cache.extend(fed)
        self._context = None  # the next classic step reads the processors' context from tokens_in_cache
        self.pending = [emitted[-1]]
        return emitted
