"""Speculation inside the continuous batch: every row's pending token and its K drafts in one verify.

mlx-lm's ``GenerationBatch`` keeps, for each row, the token it sampled last and
has not fed yet (``_next_tokens``: the classic step feeds it, emits it and
samples the next). A speculative step feeds that token and K drafts per row as
one ``(B, K + 1)`` block through the family's speculative target, accepts per
row (greedy on the device, or speculative sampling with the row's own sampling
chain), reads the step back once, ends the rows a stop token or ``max_tokens``
ends, rolls every row back to what it kept (``rollback_rows``), and leaves the
batch as a classic step would have: each row's kept tokens fed and listed in
``tokens``, its next token pending. The classic step itself is mlx-lm's,
untouched; :class:`~.batch.ContinuousBatch` picks which runs.

The rows draft together (the head's ``new_batch``: one head forward per draft
for every row), each from its own history: a solo burst's drafter hands its
state over, a row the batch prefilled starts fresh. The drafter reads the
target's hidden states: :class:`HiddenTap` runs the batch's classic steps and
its prompts' chunks through the target's forward (the model's own logits and
cache, byte for byte) and keeps their hidden states, which are paired with the
token fed after them, so a row's drafter has read its prompt by its first step
and stays caught up while it decodes classically. Worker thread only.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..models.speculative import SETTLE_EVERY, BatchDraftHead, SequenceDrafter, SpeculativeTarget, Split
from .requests import BurstStats
from .sampling import SamplingChain, SpeculativeSampler, log_probabilities


@dataclass(slots=True)
class Row:
    """One sequence's speculation in the batch."""

    sampler: SpeculativeSampler | None
    """Speculative sampling with the request's own chain; None: greedy."""
    stats: BurstStats
    eligible: bool
    """Whether its request may speculate at all (no logits processors, no logprobs)."""
    unpaired: Any = None
    """The hidden state (1, 1, H) of its last fed token, waiting for the token fed after it."""



@dataclass(slots=True)
class Fed:
    """One call of the model by mlx-lm's batch: what each row fed and the hidden states after it."""

    uids: list[int]
    inputs: Any
    """(B, L) tokens, right-padded in a prompt chunk."""
    hidden: Any
    """(B, L, H)."""
    counts: list[int]
    """How many of each row's L positions are its own (the rest: padding)."""


class HiddenTap:
    """The model as mlx-lm's ``BatchGenerator`` calls it, keeping the hidden states of what the rows fed.

    A call from ``GenerationBatch._step`` (one token per row) or from ``PromptProcessingBatch.prompt`` (a
    chunk of the rows' prompts, right-padded to the longest) goes through the target's ``forward``, whose
    logits and cache are the model's own to the bit, and what it fed is kept as a :class:`Fed` for
    :meth:`BatchSpeculation.absorb`; any other call is the model's own. The caller is told apart by its
    frame (and a chunk's place in its prompt read from the frame's locals): mlx-lm passes no other sign,
    and ``tests/test_mlx_lm_internals.py`` fails if that seam moves.
    """

    def __init__(self, model: Any, target: SpeculativeTarget) -> None:
        self.model = model
        self.target = target
        self.steps: list[Fed] = []

    def __call__(self, inputs: Any, cache: Any = None, **kwargs: Any) -> Any:
        from mlx_lm.generate import GenerationBatch, PromptProcessingBatch

        caller = sys._getframe(1)
        if kwargs:
            return self.model(inputs, cache=cache, **kwargs)
        if caller.f_code is GenerationBatch._step.__code__:
            uids = list(caller.f_locals["self"].uids)
            counts = [1] * len(uids)
        elif caller.f_code is PromptProcessingBatch.prompt.__code__:
            local = caller.f_locals
            uids = list(local["self"].uids)
            start = local["max_length"] - local["tokens"].shape[1]  # the chunk's first place in this segment
            counts = [min(max(length - start, 0), inputs.shape[1]) for length in local["lengths"]]
        else:
            return self.model(inputs, cache=cache, **kwargs)
        logits, hidden = self.target.forward(inputs, cache)
        self.steps.append(Fed(uids, inputs, hidden, counts))
        return logits

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


class BatchSpeculation:
    """The batch's rows' drafters and the speculative step."""

    def __init__(self, model: Any, target: SpeculativeTarget, head: BatchDraftHead, split: Split) -> None:
        self.target = target
        self.drafts = head.new_batch()
        self.split = split
        self.tap = HiddenTap(model, target)
        self.rows: dict[int, Row] = {}
        self.last_kept: list[int] = []
        """The drafts each row kept in the last speculative step (before a stop or max_tokens cut them)."""

    def join(self, uid: int, drafter: SequenceDrafter | None, chain: SamplingChain | None, stats: BurstStats,
             eligible: bool) -> None:
        """Row *uid* enters the batch: with the drafter it burst with alone (its history), or none (it catches
        up from its first step in the batch)."""
        self.drafts.join(uid, drafter)
        self.rows[uid] = Row(SpeculativeSampler(chain) if chain is not None else None, stats, eligible)

    def leave(self, uid: int) -> None:
        self.rows.pop(uid, None)
        self.drafts.leave(uid)

    def clear(self) -> None:
        for uid in list(self.rows):
            self.leave(uid)
        self.tap.steps.clear()

    def absorb(self, decoding: list[int]) -> None:
        """Pair the hidden states of what the rows fed (prompt chunks, classic steps) with the tokens fed after
        them, for every row's drafter; then, once one of the *decoding* rows (the batch's, in its order) holds
        :data:`SETTLE_EVERY` positions unread, have their drafters read them (a row still prefilling reads its
        prompt once it decodes)."""
        for fed in self.tap.steps:
            if max(fed.counts, default=0) > 1:  # a prompt chunk: its hidden states computed now, not held as a graph
                mx.async_eval(fed.hidden)
            for i, (uid, count) in enumerate(zip(fed.uids, fed.counts, strict=True)):
                row = self.rows.get(uid)
                if row is None or count == 0:
                    continue
                if row.unpaired is not None:
                    self.drafts.catch_up(uid, row.unpaired, fed.inputs[i:i + 1, :1])
                if count > 1:
                    self.drafts.catch_up(uid, fed.hidden[i:i + 1, :count - 1], fed.inputs[i:i + 1, 1:count])
                row.unpaired = fed.hidden[i:i + 1, count - 1:count]
        self.tap.steps.clear()
        rows = [uid for uid in decoding if uid in self.rows]
        if any(self.drafts.pending(uid) >= SETTLE_EVERY for uid in rows):
            mx.async_eval(self.drafts.settle(rows))  # bounded: queued hidden states are read in chunks

    def drafting_rows(self, uids: Sequence[int]) -> int:
        """How many of these rows would draft in a speculative step: the eligible ones, when every row's
        drafter is caught up (a row that may not draft rides along at K=0); 0 when none can, or the step
        cannot run."""
        if not uids or any(uid not in self.rows or not (self.drafts.ready(uid) or self.rows[uid].unpaired is not None)
                           for uid in uids):
            return 0
        return sum(self.rows[uid].eligible for uid in uids)

    def step(self, batch: Any, drafts: int) -> list[Any]:
        """One speculative step of mlx-lm's ``GenerationBatch`` *batch* with *drafts* drafts per row.

        Returns its ``Response``s, several per row (in order; the last of a finished row carries its
        finish reason, its cache and its tokens), and leaves *batch* as its classic ``next`` would:
        finished rows filtered out, every other row's next token pending.
        """
        started = time.perf_counter()
        rows = [self.rows[uid] for uid in batch.uids]
        width = len(rows)
        uids = list(batch.uids)
        pending = batch._next_tokens.astype(mx.int32)
        for i, row in enumerate(rows):
            if row.unpaired is not None:
                self.drafts.catch_up(uids[i], row.unpaired, pending[i:i + 1][None])
                row.unpaired = None
        drafted = self.drafts.draft(uids, drafts, batch.prompt_cache).astype(mx.int32)
        _plain_recurrent_state(batch.prompt_cache)
        verify = self.target.verify(mx.concatenate([pending[:, None], drafted], axis=1), batch.prompt_cache,
                                    self.split)
        logits = verify.logits
        # Classic decode's greedy token at every position, per row: its log-probabilities' argmax.
        greedy = mx.stack([mx.argmax(log_probabilities(logits[:, j, :]), axis=-1) for j in range(drafts + 1)],
                          axis=1)
        sampled = [row.sampler(logits[i], drafted[i]) if row.sampler is not None and row.eligible else None
                   for i, row in enumerate(rows)]
        own = {i: _classic_token(batch, i, logits[i:i + 1, 0, :], pending) for i, row in enumerate(rows)
               if not row.eligible}
        mx.eval(pending, drafted, greedy, [s for s in sampled if s is not None], [t for t, _ in own.values()])
        host_pending: list[int] = pending.tolist()  # type: ignore[assignment]
        host_drafts: list[list[int]] = drafted.tolist()  # type: ignore[assignment]
        host_greedy: list[list[int]] = greedy.tolist()  # type: ignore[assignment]
        classic = {i: int(token.item()) for i, (token, _) in own.items()}

        kept, nexts, responses, keep = [], [], [], []
        self.last_kept = []
        for i, row in enumerate(rows):
            chosen = sampled[i]
            if not row.eligible:  # K=0: its own token, by its processors and sampler, from the first position
                accepted, last = 0, classic[i]
            elif chosen is None:
                accepted = 0
                while accepted < drafts and host_drafts[i][accepted] == host_greedy[i][accepted]:
                    accepted += 1
                last = host_greedy[i][accepted]
            else:
                accepted, last = int(chosen[0].item()), int(chosen[1].item())  # type: ignore[arg-type]
            if row.eligible:
                self.last_kept.append(accepted)
                row.stats.proposed += drafts
                row.stats.accepted += accepted
                row.stats.rounds += 1
                row.stats.widths.add(width)
            fed = [host_pending[i], *host_drafts[i][:accepted]]
            count, finish = _finish(batch, i, fed)
            if count < len(fed):  # a stop token or max_tokens: the row keeps what it emitted and leaves
                fed, accepted = fed[:count], count - 1
            kept.append(accepted + 1)
            nexts.append(last)
            batch.tokens[i].extend(fed)
            # A speculating row asked for no logprobs: its pending token's (the classic step's) is passed on alone.
            previous = batch._next_logprobs[i] if i < len(batch._next_logprobs) else None
            for j, token in enumerate(fed):
                final = j == len(fed) - 1 and finish is not None
                responses.append(batch.Response(
                    uid=batch.uids[i], token=token, logprobs=previous if j == 0 else None,
                    finish_reason=finish if final else None, prompt_cache=None,
                    all_tokens=batch.tokens[i] if final else None))
            if finish is None:
                keep.append(i)
        self.target.rollback_rows(batch.prompt_cache, verify, kept)  # type: ignore[attr-defined]
        # Each row's kept positions, with the token after each: its kept drafts, then its next token.
        after = [[*host_drafts[i][:kept[i] - 1], nexts[i], *[0] * (drafts + 1 - kept[i])] for i in range(width)]
        self.drafts.accept(uids, verify.hidden, mx.array(after, dtype=mx.int32), kept, drafted=drafts)
        batch._next_tokens = mx.array(nexts, dtype=pending.dtype)
        ends = mx.array([k - 1 for k in kept])[:, None, None]
        batch._next_logprobs = list(log_probabilities(mx.take_along_axis(logits, ends, axis=1)[:, 0, :]))
        for i, (_, logprobs) in own.items():  # as its classic step gives them: after its processors
            batch._next_logprobs[i] = logprobs
        # Done within the step, so that its clock (engine/step_clock.py) holds all of its work: left lazy, the
        # rollback would be evaluated with the next step, whatever its K.
        mx.eval([layer.state for layer in batch.prompt_cache], batch._next_logprobs)
        for response in responses:  # a finished row's cache, after its rollback
            if response.finish_reason is not None:
                response.prompt_cache = batch.extract_cache(batch.uids.index(response.uid))
        if len(keep) < width:
            batch.filter(keep)
        elapsed = time.perf_counter() - started
        for row in rows:
            row.stats.round_seconds += elapsed
        return responses


def _classic_token(batch: Any, row: int, logits: Any, pending: Any) -> tuple[Any, Any]:
    """Row *row*'s next token and log-probabilities from its *logits* (1, V), as mlx-lm's classic step makes
    them: its logits processors (a grammar, penalties, a bias) over its tokens so far, then its sampler."""
    processors = batch.logits_processors[row] if batch.logits_processors else None
    if processors:
        context = batch._token_context[row].update_and_fetch(pending[row:row + 1])
        for processor in processors:
            logits = processor(context, logits)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    sampler = (batch.samplers[row] if batch.samplers else None) or batch.fallback_sampler
    return sampler(logprobs)[0], logprobs[0]


def _finish(batch: Any, row: int, fed: list[int]) -> tuple[int, str | None]:
    """How many of the tokens *fed* row *row* emits, and why it ends there (None: it goes on), as
    mlx-lm's ``GenerationBatch.next`` decides for one token a step: ``max_tokens``, then a stop sequence."""
    for count, token in enumerate(fed, start=1):
        batch._num_tokens[row] += 1
        finish = "length" if batch._num_tokens[row] >= batch.max_tokens[row] else None
        if batch._matchers[row].advance(token):
            finish = "stop"
        if finish is not None:
            return count, finish
    return len(fed), None


def _plain_recurrent_state(cache: list[Any]) -> None:
    """A recurrent layer merged into a batch keeps a left padding that only ever drops below zero once its
    rows are prefilled; it masks nothing, but a mask would hide the state the verify must keep per token."""
    for layer in cache:
        padding = getattr(layer, "left_padding", None)
        if hasattr(layer, "cache") and padding is not None and getattr(layer, "lengths", None) is None \
                and max(padding.tolist()) <= 0:
            layer.left_padding = None
