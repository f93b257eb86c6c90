"""One request's output as tokens arrive: text, stop strings, logprobs, and when it ends.

Plain Python over mlx-lm's streaming detokenizer (and, for ``top_logprobs``, an
MLX top-k of the row the decode path read back); the same for every decode path.
"""

from __future__ import annotations

import time
from typing import Any

from .requests import BurstStats, ErrorType, Finish, FinishReason, GenerationRequest, TextDelta, Timings
from .text import StopStringFilter


def _most_likely(row: Any, count: int) -> tuple[tuple[int, float], ...]:
    """The *count* most likely (token id, log-probability) of a (V,) row, most likely first."""
    import mlx.core as mx

    ids = mx.argpartition(-row, kth=count - 1)[:count]
    values = row[ids]
    order = mx.argsort(-values)
    ranked: list[int] = ids[order].tolist()  # type: ignore[assignment]
    logprobs: list[float] = values[order].tolist()  # type: ignore[assignment]
    return tuple(zip(ranked, logprobs, strict=True))


class SequenceOutput:
    """Turns a request's tokens into :class:`TextDelta` events and notices when it is finished."""

    def __init__(self, request: GenerationRequest, detokenizer: Any, eos_tokens: frozenset[int]) -> None:
        self.request = request
        self.detokenizer = detokenizer
        self.stop = StopStringFilter(request.stop)
        self.eos_tokens = eos_tokens
        self.generated = 0
        self.first_token_at: float | None = None
        self.finish_reason: FinishReason | None = None
        self._tokens: list[int] = []
        self._logprobs: list[float] = []
        self._top: list[tuple[tuple[int, float], ...]] = []

    @property
    def remaining(self) -> int:
        return self.request.max_tokens - self.generated

    def natural_finish(self, token: int) -> FinishReason | None:
        """Why a sequence ends with *token* on its own: end of sequence, or max_tokens."""
        if token in self.eos_tokens:
            return "stop"
        return "length" if self.remaining == 1 else None

    def on_token(self, token: int, logprobs: Any, reason: FinishReason | None) -> TextDelta | None:
        """Account for one generated token; the text it releases, if any.

        *reason* is why the decode path ends the sequence with this token (a
        ``stop`` reason is an end-of-sequence token: it ends the text and is
        not part of it). Sets :attr:`finish_reason` when the sequence is done,
        a stop string included.
        """
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        text = ""
        if reason != "stop":
            self.generated += 1
            self.detokenizer.add_token(token)
            text = self.stop.feed(self.detokenizer.last_segment)
            self._tokens.append(token)
            if self.request.logprobs and logprobs is not None:
                row = logprobs.reshape(-1)
                self._logprobs.append(row[token].item())
                if self.request.top_logprobs:
                    self._top.append(_most_likely(row, self.request.top_logprobs))
        if self.stop.stopped:
            reason = "stop"
        if reason is not None:
            self.detokenizer.finalize()
            if not self.stop.stopped:
                text += self.stop.feed(self.detokenizer.last_segment) + self.stop.flush()
            self.finish_reason = reason
        if not text and not (reason is not None and self._tokens):
            return None
        delta = TextDelta(text, tuple(self._tokens), tuple(self._logprobs) if self.request.logprobs else None,
                          tuple(self._top) if self.request.top_logprobs else None)
        self._tokens.clear()
        self._logprobs.clear()
        self._top.clear()
        return delta

    def finish(self, reason: FinishReason, admitted: float, cached: int, burst: BurstStats | None,
               error: str | None = None, error_type: ErrorType = "server_error") -> Finish:
        """The request's last event: why it ended, its usage, and its timings in llama.cpp's names."""
        now = time.perf_counter()
        first = self.first_token_at or now
        prompt = len(self.request.prompt_tokens)
        return Finish(
            reason=reason, prompt_tokens=prompt, completion_tokens=self.generated,
            timings=Timings(
                prompt_n=prompt - cached, prompt_ms=(first - admitted) * 1000, predicted_n=self.generated,
                predicted_ms=(now - first) * 1000, cached_n=cached,
                draft_n=burst.proposed if burst else 0, draft_n_accepted=burst.accepted if burst else 0,
                draft_rounds=burst.rounds if burst else 0,
                draft_widths=tuple(sorted(burst.widths)) if burst else ()),
            error=error, error_type=error_type, stop_sequence=self.stop.matched)
