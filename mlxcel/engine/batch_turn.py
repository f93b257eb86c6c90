"""The worker's batch turn: sequences into the continuous batch, one step, its tokens delivered.

The scheduler says when (:class:`~.scheduler.BatchTurn`); this does it with
MLX: a waiting sequence or a parked solo one goes into the batch (with its
drafter, where the batch speculates), the batch steps (classic or speculative,
:mod:`.batch`), each sequence's tokens are handed to its client, and the ones
that finished leave with their caches kept. A failure of one sequence's own
handling ends that one; a failure of the step fails the batch, which is
rebuilt. Worker thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from .scheduler import BatchTurn
from .sequence import Sequence
from .solo_turn import SoloHost, snapshot_marks

if TYPE_CHECKING:
    from .batch import ContinuousBatch
    from .batch_mtp import BatchMtp

logger = logging.getLogger(__name__)

Events = list[tuple[str, Any]]


class BatchHost(SoloHost, Protocol):
    """What a batch turn needs of the worker beyond a solo turn's (the worker is one; this imports none)."""

    batch: ContinuousBatch[Sequence] | None
    batch_mtp: BatchMtp | None
    sequences: dict[str, Sequence]
    snapshots: bool

    def fail(self, sequences: list[Sequence], exc: Exception) -> None: ...


class BatchTurns:
    """Serves the batch turns of *worker*."""

    def __init__(self, worker: BatchHost) -> None:
        self.worker = worker

    def insert(self, sequence: Sequence) -> None:
        """Insert *sequence* into the batch: waiting (the batch prefills its prompt), or a parked solo one
        (prefilled or part-prefilled: its cache, and the tokens it still has to feed)."""
        from .grammar import GrammarProcessor

        worker = self.worker
        assert worker.batch is not None
        solo = sequence.solo
        drafter = solo.burst.drafter if solo is not None and solo.burst is not None else None  # its history
        if solo is None:
            assert sequence.prompt_state is not None
            cache, cached, pending = sequence.prompt_state
            sequence.prompt_state = None
        else:
            assert solo.parked
            sequence.solo = None
            cache, cached, pending = solo.cache, solo.tokens_in_cache, solo.pending
            worker.observability.handoffs.inc()
        for processor in sequence.processors:
            if isinstance(processor, GrammarProcessor):
                processor.deferring = True  # a grammar failing in the batch ends its own sequence only
        marks = snapshot_marks(sequence.request) if worker.snapshots else ()
        uid = worker.batch.insert(sequence, pending, cache, cached, sequence.output.remaining, sequence.sampler,
                                  sequence.processors, marks)
        sequence.ever_batched = True
        if worker.batch_mtp is not None:
            worker.batch_mtp.join(uid, sequence, drafter, worker.speculation)

    def insert_each(self, request_ids: Iterable[str]) -> None:
        """:meth:`insert` for each; one that cannot go in fails alone."""
        worker = self.worker
        for request_id in request_ids:
            sequence = worker.sequences[request_id]
            try:
                self.insert(sequence)
            except Exception as exc:
                worker.fail([sequence], exc)

    def advance(self, turn: BatchTurn) -> None:
        worker = self.worker
        assert worker.batch is not None
        self.insert_each(turn.insert)
        if not worker.batch.sequences:
            return
        try:
            self._step(worker.batch)
        except Exception as exc:
            worker.fail(worker.batch.sequences, exc)
            self._rebuild()

    def _step(self, batch: ContinuousBatch[Sequence]) -> None:
        """One step of the batch. If the step itself raises, the caller fails the batch and rebuilds
        it; a failure in one sequence's own handling (its text, its logprobs) ends that one only."""
        worker = self.worker
        if worker.instrument is not None:
            for sequence in batch.sequences:
                worker.instrument.at("batch_step", sequence.request)
        stepped = batch.step()
        if stepped.tokens:
            worker.observability.batch_steps.labels(drafts=str(stepped.drafts)).inc()
            if worker.batch_mtp is not None:
                worker.batch_mtp.stepped()
        for tokens, cache in stepped.snapshots:
            worker.snapshot(tokens, cache, None)
        events: Events = []
        finished: dict[int, tuple[Sequence, Any]] = {}
        failed: list[tuple[Sequence, Exception]] = []
        for sequence, response in stepped.tokens:  # a speculative step gives a sequence several, in order
            if id(sequence) in finished or any(s is sequence for s, _ in failed):
                if response.finish_reason is not None and id(sequence) in finished:
                    finished[id(sequence)] = (sequence, response)  # the one that carries its cache
                continue
            if (grammar := sequence.grammar_failure()) is not None:
                failed.append((sequence, grammar))  # its token came from unmasked logits: never delivered
                continue
            try:
                delta = sequence.output.on_token(response.token, response.logprobs, response.finish_reason)
            except Exception as exc:
                failed.append((sequence, exc))
                continue
            worker.observability.count_generated()
            if delta is not None:
                events.append((sequence.request.id, delta))
            if sequence.output.finish_reason is not None:
                finished[id(sequence)] = (sequence, response)
        try:
            if finished:  # a take_out that raises leaves them in the batch, which then fails whole
                kept = batch.take_out(list(finished.values()))
                for sequence, _ in finished.values():
                    cache, tokens = kept[id(sequence)]
                    worker.keep(worker.cache_keys(sequence, tokens), cache)
                    worker.forget(sequence)
                    assert sequence.output.finish_reason is not None
                    events.append((sequence.request.id, worker.finish(sequence, sequence.output.finish_reason)))
                worker.observability.cache = worker.prefix.stats()
        finally:  # what was built is delivered, whatever happens after
            worker.publish_load()
            if events:
                worker.deliver(events)
        for sequence, error in failed:
            worker.fail([sequence], error)

    def _rebuild(self) -> None:
        worker = self.worker
        assert worker.batch is not None
        try:
            worker.batch.rebuild()
        except Exception as exc:  # no batch to be had: serve on, one sequence at a time
            logger.error("the continuous batch could not be rebuilt (%s: %s): serving one sequence at a time",
                         type(exc).__name__, exc)
            worker.batch = None
            worker.scheduler.batch_lost(f"the batch could not be rebuilt: {exc}")
