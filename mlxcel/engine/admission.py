"""What comes into the worker: its inbox (submit, cancel, stop), admission, and handoff into the batch.

A mixin of :class:`~mlxcel.engine.worker.Worker`, kept apart because it is one
job: deciding where each request goes. A lone request is parked to decode solo
(its prompt prefilled on its turn); anything more joins the continuous batch,
and a solo sequence (started, part-prefilled or not) moves into it with its
cache and the tokens it still has to feed.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from typing import Any

from ..observability import Observability
from .batch import ContinuousBatch
from .messages import Message, Stop, Submit, WorkerSettings
from .output import SequenceOutput
from .requests import Event, Finish, FinishReason, GenerationRequest
from .sequence import Sequence

logger = logging.getLogger(__name__)

#: How long an idle worker waits for work before checking for cancellation.
IDLE_POLL_SECONDS = 0.05


class Admission:
    """The worker's inbox and admission. The state and the helpers below are the worker's."""

    settings: WorkerSettings
    observability: Observability
    inbox: queue.SimpleQueue[Message]
    model: Any
    stream: Any
    sharded: bool
    tokenizer: Any
    eos_tokens: frozenset[int]
    batch: ContinuousBatch[Sequence] | None
    prefix: Any
    _sequences: dict[str, Sequence]
    _deliver: Callable[[list[tuple[str, Event]]], None]

    # Defined by the worker (these stubs only declare them).
    def _fault(self, point: str, request: GenerationRequest) -> None: ...
    def _fail(self, sequences: list[Sequence], exc: Exception) -> None: ...
    def _forget(self, sequence: Sequence) -> None: ...
    def _publish_load(self) -> None: ...

    def _finish(self, sequence: Sequence, reason: FinishReason, error: str | None = None) -> Finish:
        raise NotImplementedError

    def _take_messages(self, block: bool) -> bool:
        """Handle every message waiting (waiting a little if *block*); False on Stop."""
        events: list[tuple[str, Event]] = []
        submitted: dict[str, GenerationRequest] = {}
        try:
            message = self.inbox.get(timeout=IDLE_POLL_SECONDS) if block else self.inbox.get_nowait()
        except queue.Empty:
            return True
        try:
            while True:
                if isinstance(message, Stop):
                    self._end_all("error", message.reason, events)
                    for request in submitted.values():
                        events.append((request.id, Finish("error", len(request.prompt_tokens), 0,
                                                          error=message.reason)))
                    self._deliver(events)
                    return False
                if isinstance(message, Submit):
                    submitted[message.request.id] = message.request
                elif message.request_id in submitted:
                    request = submitted.pop(message.request_id)
                    # Cancelled in the same drain as its Submit: never admitted, never generated.
                    events.append((request.id, Finish("cancelled", len(request.prompt_tokens), 0,
                                                      error="the client went away")))
                else:
                    self._cancel(message.request_id, events)
                message = self.inbox.get_nowait()
        except queue.Empty:
            pass
        if submitted:
            self._admit(list(submitted.values()), events)
        self._publish_load()
        if events:
            self._deliver(events)
        return True

    def _admit(self, requests: list[GenerationRequest], events: list[tuple[str, Event]]) -> None:
        """A lone request decodes solo; anything more joins (or moves into) the continuous batch."""
        from .grammar import GrammarProcessor
        from .prompt_scoring import score_prompt
        from .sampling import make_processors, make_sampler, sampler_with_hook

        alone = not self._sequences and len(requests) == 1
        joining = None if alone else self.batch  # the batch everything joins, if any
        batch = joining is not None
        if joining is not None:
            for sequence in list(self._sequences.values()):
                if sequence not in joining:
                    try:
                        self._into_batch(sequence)
                    except Exception as exc:
                        self._fail([sequence], exc)
        for request in requests:
            tokens = list(request.prompt_tokens)
            if request.prompt_logprobs and self.sharded:
                # Scoring is a forward of its own, between the running sequence's: the other ranks would
                # not know which cache it runs on (mlxcel.distributed.mirror).
                events.append((request.id, Finish("error", len(tokens), 0, error_type="invalid_request_error",
                                                  error="the prompt's log-probabilities (echo with logprobs) "
                                                        "are not computed on a sharded model")))
                continue
            try:
                chain = make_sampler(request.sampling)
                sampler: Callable[[Any], Any] | None = chain
                if self.settings.fault_hook is not None:
                    sampler = sampler_with_hook(chain, lambda r=request: self._fault("sampler", r))
                cache, rest = self.prefix.fetch(tokens)
                processors = make_processors(request.sampling, len(tokens))
                if request.sampling.grammar is not None:  # last: it masks what the others computed
                    processors.append(GrammarProcessor(request.sampling.grammar, len(tokens)))
                sequence = Sequence(request=request, chain=chain, sampler=sampler, processors=processors,
                                     output=SequenceOutput(request, self.tokenizer.detokenizer, self.eos_tokens),
                                     admitted=time.perf_counter(), cached=len(tokens) - len(rest))
                cached_tokens = tokens[:len(tokens) - len(rest)]
                if request.prompt_logprobs:  # first of the request's events: one forward over the prompt
                    events.append((request.id, score_prompt(self.model, self.stream, tokens, request.top_logprobs)))
                if batch:
                    self._insert(sequence, rest, cache, cached_tokens, request.max_tokens)
                else:
                    sequence.prompt_state = (cache, cached_tokens, rest)  # prefilled on its solo turn
            except Exception as exc:  # a request the model cannot take must not stop the worker
                logger.error("request %s could not be admitted: %s: %s", request.id, type(exc).__name__, exc)
                events.append((request.id, Finish("error", len(tokens), 0,
                                                  error=f"cannot start generation: {exc}")))
                continue
            self._sequences[request.id] = sequence
            self.observability.prompt_tokens.inc(len(tokens))
        self.observability.cache = self.prefix.stats()

    def _insert(self, sequence: Sequence, tokens: list[int], cache: Any, cached: list[int], max_tokens: int) -> None:
        from .grammar import GrammarProcessor

        assert self.batch is not None
        for processor in sequence.processors:
            if isinstance(processor, GrammarProcessor):
                processor.deferring = True  # a grammar failing in the batch ends its own sequence only
        self.batch.insert(sequence, tokens, cache, cached, max_tokens, sequence.sampler, sequence.processors)
        sequence.ever_batched = True

    def _into_batch(self, sequence: Sequence) -> None:
        """Hand a parked solo sequence (prefilled, part-prefilled or not started) to the batch."""
        solo = sequence.solo
        remaining = sequence.output.remaining
        if solo is None:  # not started: the batch prefills it
            assert sequence.prompt_state is not None
            cache, cached_tokens, rest = sequence.prompt_state
            sequence.prompt_state = None
            self._insert(sequence, rest, cache, cached_tokens, remaining)
            return
        assert solo.parked
        sequence.solo = None
        self._insert(sequence, solo.pending, solo.cache, solo.tokens_in_cache, remaining)
        self.observability.handoffs.inc()

    def _cancel(self, request_id: str, events: list[tuple[str, Event]]) -> None:
        sequence = self._sequences.get(request_id)
        if sequence is None:
            return
        self._forget(sequence)
        events.append((request_id, self._finish(sequence, "cancelled", "the client went away")))

    def _end_all(self, reason: FinishReason, error: str, events: list[tuple[str, Event]]) -> None:
        for sequence in list(self._sequences.values()):
            self._forget(sequence)
            events.append((sequence.request.id, self._finish(sequence, reason, error)))
