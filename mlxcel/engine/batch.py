"""Continuous batching: mlx-lm's ``BatchGenerator``, keyed by the worker's own sequences.

Worker thread only. mlx-lm does the scheduling (prefill and decode batches,
stop tokens, per-sequence samplers and caches); this wrapper maps its uids to
whatever the worker tracks, and rebuilds the generator when a step failed.
With speculation (:mod:`.batch_speculation`), each step is either mlx-lm's
classic step or a speculative one, K drafts per row, as the
:class:`~mlxcel.policy.draft_length.DraftLength` rule picks from the measured
costs of both; then a chunk of each prompt waiting, each prompt alone, so that
no prompt's cache rounds with the prompts that arrived beside it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from .step_clock import StepClock

if TYPE_CHECKING:
    from ..policy.draft_length import DraftLength
    from .batch_speculation import BatchSpeculation

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Stepped(NamedTuple, Generic[T]):
    """What one :meth:`ContinuousBatch.step` did."""

    tokens: list[tuple[T, Any]]
    """(sequence, mlx-lm's response) for every sequence that produced a token."""
    snapshots: list[tuple[list[int], list[Any]]]
    """(the tokens it holds, a copy of the cache) for every sequence whose prefill reached one of its marks."""
    drafts: int = 0
    """Drafts per row the step verified (0: the classic step)."""


class ContinuousBatch(Generic[T]):
    """The batch: sequences (of any type *T*) decoding together, one ``step`` at a time."""

    def __init__(self, model: Any, eos_tokens: frozenset[int], parallel: int, prefill_step_size: int,
                 stream: Any, speculation: BatchSpeculation | None = None, rule: DraftLength | None = None) -> None:
        runs = speculation.tap if speculation is not None else model  # the tap keeps the drafters' hidden states
        self._make: Callable[[], Any] = lambda: _generator(runs, eos_tokens, parallel, prefill_step_size, stream)
        self._generator = self._make()
        self._stream = stream
        self.speculation = speculation
        self.rule = rule
        self._clock = StepClock(rule, self._finish) if speculation is not None and rule is not None else None
        self._by_uid: dict[int, T] = {}
        self._uids: dict[int, int] = {}  # id(sequence) -> uid
        self._marks: dict[int, set[int]] = {}  # uid -> marks still to pass, counted in the tokens it feeds

    def __contains__(self, sequence: T) -> bool:
        return id(sequence) in self._uids

    @property
    def sequences(self) -> list[T]:
        return list(self._by_uid.values())

    def insert(self, sequence: T, tokens: list[int], cache: list[Any] | None, cached: list[int],
               max_tokens: int, sampler: Any, processors: list[Any], marks: Iterable[int] = ()) -> int:
        """Add *sequence*: *tokens* still to feed on top of *cache* (holding *cached*), or a fresh prompt.

        *processors* (mlx-lm's logits processors) see every token of the sequence, *cached* included.
        *marks*: prompt positions (counted from the start, *cached* included) at which :meth:`step`
        hands back a copy of the sequence's cache, for the prefix cache's snapshots; its prefill
        stops at each (mlx-lm's prompt segments).
        """
        cuts = sorted({m - len(cached) for m in marks if 0 < m - len(cached) < len(tokens)})
        segments = [tokens[a:b] for a, b in itertools.pairwise([0, *cuts, len(tokens)])]
        (uid,) = self._generator.insert_segments([segments], max_tokens=[max_tokens],
                                                 caches=[cache] if cache is not None else None,
                                                 all_tokens=[cached], samplers=[sampler],
                                                 logits_processors=[processors])
        self._by_uid[uid] = sequence
        self._uids[id(sequence)] = uid
        if cuts:
            self._marks[uid] = set(cuts)
        return uid

    def step(self) -> Stepped[T]:
        """One step: a token for every decoding sequence (or K drafts' worth, speculating), a prefill chunk
        for the others."""
        import mlx.core as mx

        generation = self._generator._generation_batch
        width, depth, drafts, ready, steady = len(generation), 0, 0, False, False
        speculation, rule, clock = self.speculation, self.rule, self._clock
        waiting = len(self._generator._unprocessed_sequences) + len(self._generator._currently_processing)
        if speculation is not None and rule is not None and clock is not None:
            depth = max((len(tokens) for tokens in generation.tokens), default=0)  # the deepest row's context
            steady = clock.begin(generation.uids, depth)
            drafting = speculation.drafting_rows(generation.uids)  # the others ride along at K=0
            ready = drafting > 0
            if ready:
                drafts = rule.choose(width, depth, drafting, measurable=steady)
        self._admission()
        if drafts:
            assert speculation is not None and rule is not None and clock is not None
            clock.start(drafts)
            with mx.stream(self._stream):
                speculated = speculation.step(generation, drafts)
            clock.speculative_done(width, depth, speculation.last_kept, steady)
            generation.next = list  # this step's tokens are made: mlx-lm's step does the prompts' side only
            try:
                prompts, responses = self._generator.next()
            finally:
                del generation.next
            responses = speculated + responses
        else:
            timed = ready and steady and not waiting  # a classic step the rule chose, on the same rows, alone
            if clock is not None:
                clock.classic(width, depth, measured=timed)
            prompts, responses = self._generator.next()
            if clock is not None and timed:
                clock.classic_done(len(self._generator._generation_batch))
        if waiting:
            prompts = prompts + self._prompts_alone(waiting - 1)
        if speculation is not None:
            speculation.absorb(list(self._generator._generation_batch.uids))
        snapshots = []
        for response in prompts:
            marks = self._marks.get(response.uid)
            fed = response.progress[0]  # of the tokens the sequence came in with, not counting its cache's
            if marks and response.end_of_segment and fed in marks:
                marks.discard(fed)
                cache, held = self._generator.extract_cache([response.uid])[response.uid]
                mx.eval([layer.state for layer in cache])  # its own arrays, not views of the batch's
                snapshots.append((list(held), cache))
        return Stepped([(self._by_uid[r.uid], r) for r in responses if r.uid in self._by_uid], snapshots, drafts)

    def _finish(self) -> None:
        """Wait for the batch's work queued on the device: its last forward (mlx-lm's step queues the next
        one's before it waits for the last one's tokens)."""
        import mlx.core as mx

        pending = self._generator._generation_batch._next_tokens
        if pending is not None:
            mx.eval(pending)

    def _prompts_alone(self, passes: int) -> list[Any]:
        """Up to *passes* more prompt chunks in this step, each of one prompt alone, the batch's rows set aside
        meanwhile so that they do not step again.

        mlx-lm's prompt batch holds one prompt here (prompts prefilled together, right-padded to the longest,
        would round with each other), so each of its passes advances one; as many chunks as prompts were
        waiting give a step the prefill work a batched prefill would, without keeping the batch's rows
        waiting a step for each prompt. A prompt whose chunk left only its last token takes its first step
        alone in a pass of its own, which prefills nothing and is not counted: so it joins in the step of
        its last chunk, as in a batched prefill, not one step later. The prompts that finished join the
        rows together after the last pass (:func:`~mlxcel.models.batch_rows.join_rows`): one copy of the
        batch's caches, not one per prompt.
        """
        from mlx_lm.generate import GenerationBatch

        from ..models.batch_rows import join_rows

        generator = self._generator
        rows = generator._generation_batch
        prompts: list[Any] = []
        joined: list[Any] = []
        chunks = 0
        try:
            while generator._unprocessed_sequences or generator._currently_processing:
                starting = any(len(entry[0]) == 1 and len(entry[0][0]) == 1  # mlx-lm's own test (BatchGenerator)
                               for entry in generator._currently_processing)
                if chunks >= passes and not starting:
                    break
                chunks += not starting
                # Empty each pass: a row that joined in the last one must not step again before the batch does.
                generator._generation_batch = GenerationBatch.empty(generator.model, generator.sampler)
                self._admission()
                done, _ = generator.next()
                prompts += done
                if len(generator._generation_batch):
                    joined.append(generator._generation_batch)
        finally:
            generator._generation_batch = rows
            join_rows(rows, joined)  # one copy of the batch's caches for all of them
        return prompts

    def _admission(self) -> None:
        """How many prompts mlx-lm's prompt batch takes in its next pass: one (prompts prefilled together round
        with each other), or, while it is empty, every waiting prompt in a row that has only its last token
        left (one the prefix cache held): their first step is one position a row, the same bytes together as
        alone (:mod:`~mlxcel.models.row_exact`), and one step for all of them."""
        generator = self._generator
        ready = 0
        if not generator._currently_processing:
            for entry in generator._unprocessed_sequences:  # (uid, segments, ...): the last segment is one token
                if len(entry[1]) != 1:
                    break
                ready += 1
        generator.prefill_batch_size = max(1, ready)

    def take_out(self, finished: list[tuple[T, Any]]) -> dict[int, tuple[Any, list[int]]]:
        """Remove *finished* sequences; the (cache, tokens) of each, by ``id(sequence)``, to keep.

        A sequence mlx-lm finished itself (a stop token, max_tokens) left the
        batch already and its response carries its cache; one the worker
        ended (a stop string) is taken out here with its cache.
        """
        still = [(s, self._uids[id(s)]) for s, r in finished if r.finish_reason is None]
        removed = self._generator.remove([uid for _, uid in still], return_prompt_caches=True) if still else {}
        kept = {}
        for sequence, response in finished:
            uid = self._uids.pop(id(sequence))
            self._forget(uid)
            kept[id(sequence)] = removed.get(uid, (response.prompt_cache, response.all_tokens))
        return kept

    def discard(self, sequence: T) -> None:
        """Take *sequence* out without keeping anything (cancelled, failed)."""
        uid = self._uids.pop(id(sequence), None)
        if uid is None:
            return
        self._forget(uid)
        try:
            self._generator.remove([uid])
        except Exception:  # a broken generator is rebuilt by the worker anyway
            logger.debug("could not remove a sequence from the batch", exc_info=True)

    def _forget(self, uid: int) -> None:
        self._by_uid.pop(uid, None)
        self._marks.pop(uid, None)
        if self.speculation is not None:
            self.speculation.leave(uid)

    def rebuild(self) -> None:
        """After a failed step: forget every sequence and start a fresh generator."""
        self.close()
        self._by_uid.clear()
        self._uids.clear()
        self._marks.clear()
        if self.speculation is not None:
            self.speculation.clear()
        if self._clock is not None:
            self._clock.forget()
        self._generator = self._make()

    def close(self) -> None:
        self._generator.close()


def _generator(model: Any, eos_tokens: frozenset[int], parallel: int, prefill_step_size: int, stream: Any) -> Any:
    from types import MethodType

    from mlx_lm.generate import BatchGenerator

    from ..models.batch_rows import filter_rows

    # One place more than `parallel`: the scheduler's overflow place (engine/scheduler.py) is the bound that
    # counts; mlx-lm would otherwise keep the overflowing sequence in its own queue. Its prompt batch holds one
    # prompt (ContinuousBatch._prompts_alone runs a chunk for each prompt waiting): prefilled together,
    # right-padded to the longest, a prompt's cache would round with the prompts that happened to arrive
    # beside it (products of all their rows, attention over the padded length), and so would every token
    # after it (docs/mtp.md, "A row's bytes are its own").
    generator = BatchGenerator(model, stop_tokens=[[t] for t in sorted(eos_tokens)],
                               completion_batch_size=parallel + 1, prefill_batch_size=1,
                               prefill_step_size=prefill_step_size, stream=stream)
    # Rows leaving (finished, removed, a speculative step's stops) cost one copy of the caches, not two. The
    # generator keeps this one GenerationBatch for its life (ContinuousBatch._prompts_alone sets it back).
    rows = generator._generation_batch
    rows.filter = MethodType(filter_rows, rows)
    return generator


def batchable(model: Any) -> bool:
    """Whether every cache of *model* can be merged into a batch (mlx-lm's own test)."""
    from mlx_lm.models.cache import make_prompt_cache

    return all(hasattr(cache, "merge") for cache in make_prompt_cache(model))
