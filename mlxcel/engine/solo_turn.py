"""The worker's solo turn: a lone sequence prefilled, decoded classically or by the B=1 burst, retired.

The scheduler says whose turn it is (:class:`~.scheduler.SoloTurn`); this does
it with MLX, until the sequence finishes or the worker has mail (then the
sequence parks, ready to be handed to the batch or resumed). Worker thread only.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import trio

from ..observability import Observability
from ..policy import MtpPolicy
from .instrument import Instrument
from .messages import Inbound, WorkerSettings
from .requests import ErrorType, Event, Finish, FinishReason, GenerationRequest
from .scheduler import Scheduler, burst_allowed
from .sequence import Sequence

if TYPE_CHECKING:
    from .batch_mtp import BatchMtp
    from .solo import SoloDecoder
    from .speculation import Speculation


class SoloHost(Protocol):
    """What a solo turn needs of the worker that serves it (the worker is one; this module imports none)."""

    settings: WorkerSettings
    inbox: queue.SimpleQueue[Inbound]
    instrument: Instrument | None
    observability: Observability
    policy: MtpPolicy
    scheduler: Scheduler
    speculation: Speculation | None
    batch_mtp: BatchMtp | None
    """Its rule of K decides a lone request's rounds too (width 1)."""
    model: Any
    stream: Any
    prefix: Any
    new_cache: Callable[[], list[Any]]

    def deliver(self, events: list[tuple[str, Event]]) -> None: ...

    def snapshot(self, tokens: list[int], cache: Any, drafter: tuple[int, Any] | None) -> None: ...

    def keep(self, tokens: list[int], cache: Any) -> None: ...

    def cache_keys(self, sequence: Sequence, tokens: list[int]) -> list[int]: ...

    def forget(self, sequence: Sequence) -> None: ...

    def finish(self, sequence: Sequence, reason: FinishReason, error: str | None = None,
               error_type: ErrorType = "server_error") -> Finish: ...

    def publish_load(self) -> None: ...

#: A decoding solo sequence checks for cancellation of the whole engine every this many tokens.
CANCEL_CHECK_TOKENS = 16


def snapshot_marks(request: GenerationRequest) -> list[int]:
    """Where a solo prefill keeps snapshots of a cache that cannot be rewound, in order: the request's
    checkpoints, and the end of its prompt but the last token (which the first step feeds), what a later
    prompt extending this one, or the same prompt again, resumes from."""
    end = len(request.prompt_tokens) - 1
    if request.images:  # its tokens are not its prompt: nothing of it is offered to the prefix cache
        return []
    return sorted({m for m in request.checkpoints if 0 < m < end} | ({end} if end > 0 else set()))


class SoloTurns:
    """Serves the solo turns of *worker* (its model, its policy, its delivery of events)."""

    def __init__(self, worker: SoloHost) -> None:
        self.worker = worker

    def _mail(self) -> bool:
        return not self.worker.inbox.empty()

    def advance(self, sequence: Sequence) -> None:
        """Start, prefill (a chunk at a time, watching the inbox) and decode the lone sequence."""
        worker = self.worker
        if sequence.solo is None:
            sequence.solo = self._start(sequence)
        solo = sequence.solo
        marks = snapshot_marks(sequence.request)
        while not solo.prefilled:
            if worker.instrument is not None:
                worker.instrument.at("prefill", sequence.request)
            done = len(solo.tokens_in_cache)
            mark = next((m for m in marks if m > done), None)  # a chunk ends at the next mark
            solo.prefill_chunk(min(worker.settings.prefill_step_size, mark - done if mark else 1 << 62))
            done = len(solo.tokens_in_cache)
            if done in marks:
                drafter = solo.burst.drafter if solo.burst is not None else None
                worker.snapshot(solo.tokens_in_cache, solo.cache,
                                (sequence.request.prompt_tokens[done], drafter) if drafter is not None else None)
            if self._mail():
                return  # a cancel, a stop or a new request is seen within one chunk
        if solo.burst is not None:
            from .burst_loop import run_burst

            rule = worker.batch_mtp.rule if worker.batch_mtp is not None else None
            lone_steps = worker.observability.lone_steps
            run_burst(solo, sequence.output, worker.settings.block_size, worker.policy.profiling,
                      mail=self._mail, emit=lambda tokens: self.deliver(sequence, tokens),
                      rule=rule, parked_from=worker.policy.depth_limit,
                      counted=lambda drafts, steps: lone_steps.labels(drafts=str(drafts)).inc(steps))
        else:
            self._run_classic(sequence, solo)

    def _start(self, sequence: Sequence) -> SoloDecoder:
        from .solo import SoloDecoder

        worker = self.worker
        assert sequence.prompt_state is not None
        cache, cached_tokens, rest = sequence.prompt_state
        sequence.prompt_state = None
        if cache is None:
            cache = worker.new_cache()
        request = sequence.request
        probe = sequence.probe
        burst = None
        speculation = worker.speculation
        depth = len(cached_tokens) + len(rest)
        if speculation is not None and speculation.split is not None and \
                burst_allowed(worker.scheduler.capabilities, request, bool(worker.policy.mtp_enabled)):
            from .burst import Burst
            from .sampling import SpeculativeSampler

            chain = sequence.chain
            drafter = speculation.drafter.new_sequence(cache)
            if sequence.drafter_state is not None:  # caught up on the resumed prefix, as after a prefill
                drafter.restore(sequence.drafter_state)
            burst = Burst(speculation.target, drafter, speculation.split,
                          SpeculativeSampler(chain) if chain is not None else None, probe=probe,
                          processors=sequence.processors)
            burst.stats.depth = depth
            sequence.burst = burst.stats
        return SoloDecoder(worker.model, worker.stream, sequence.sampler, cache, list(cached_tokens), list(rest),
                           burst, probe=probe, processors=sequence.processors)

    def _run_classic(self, sequence: Sequence, solo: SoloDecoder) -> None:
        """Decode *sequence* alone until it finishes or a message arrives (then it parks)."""
        output = sequence.output
        solo.resume()
        while True:
            # Stop feeding once the token about to be emitted is the last allowed,
            # or when the worker has mail: then the sequence parks, ready to batch.
            token, logprobs = solo.emit(feed_next=output.remaining > 1 and not self._mail())
            self.deliver(sequence, [token], logprobs)
            if output.finish_reason is not None or solo.parked:
                return
            if output.generated % CANCEL_CHECK_TOKENS == 0:
                self.worker.publish_load()
                trio.from_thread.check_cancelled()

    def deliver(self, sequence: Sequence, tokens: list[int], logprobs: Any = None) -> bool:
        """Hand a solo sequence's new *tokens* to its client; retire it if they finish it. True when finished."""
        worker = self.worker
        events: list[tuple[str, Event]] = []
        output = sequence.output
        for token in tokens:
            delta = output.on_token(token, logprobs, output.natural_finish(token))
            worker.observability.count_generated()
            if delta is not None:
                events.append((sequence.request.id, delta))
            if output.finish_reason is not None:
                break
        finished = output.finish_reason is not None
        if finished:
            assert sequence.solo is not None
            self._retire(sequence, sequence.solo, events)
        if events:
            worker.deliver(events)
        return finished

    def _retire(self, sequence: Sequence, solo: SoloDecoder, events: list[tuple[str, Event]]) -> None:
        """A solo sequence finished: keep its cache, report its burst, send its Finish."""
        worker = self.worker
        if solo.round_in_flight:  # a stop string ended it with a round on the device: drop that round
            solo.finish_round(count=False)
        worker.keep(worker.cache_keys(sequence, solo.tokens_in_cache), solo.cache)
        worker.forget(sequence)
        stats = sequence.burst
        # A sample needs classic decode timed beside it: never let the static gate pass for a measurement.
        if stats is not None and stats.rounds and stats.classic_steps and not sequence.ever_batched:
            worker.policy.on_sample(stats.sample())
        if worker.batch_mtp is not None and stats is not None:
            worker.batch_mtp.lone_finished()
        assert sequence.output.finish_reason is not None
        events.append((sequence.request.id, worker.finish(sequence, sequence.output.finish_reason)))
        worker.observability.cache = worker.prefix.stats()
        worker.publish_load()
