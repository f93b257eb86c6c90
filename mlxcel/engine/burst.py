"""The B=1 MTP burst's rounds: K-1 drafts on device, one K-wide verify, acceptance, rollback.

Family-agnostic: the target and the drafter come in through the protocols of
:mod:`mlxcel.models.speculative`. At temperature 0 acceptance is greedy (the
longest prefix of drafts equal to the target's own argmax, plus the target's
next token), so the output is classic decode's byte for byte *if* the verify is
exact, which :mod:`.exactness` checks at boot. A request's logits processors
(bias, penalties, a grammar) are applied at every verify position as classic
decode applies them, so that holds for such requests too. Worker thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..models.speculative import SequenceDrafter, SpeculativeTarget, Split, Verify
from .grammar import GrammarProcessor
from .instrument import Probe
from .requests import BurstStats
from .sampling import SpeculativeSampler, log_probabilities

#: While profiling, classic decode is timed inside the burst: CLASSIC_SAMPLE_STEPS pipelined
#: single-token steps after the first round (so that even a short request measures it), and
#: again after every CLASSIC_SAMPLE_EVERY rounds.
CLASSIC_SAMPLE_EVERY = 4
CLASSIC_SAMPLE_STEPS = 3


def classic_sample_due(stats: BurstStats) -> bool:
    """Whether the burst owes the policy a timing of classic decode now (while profiling)."""
    if stats.rounds == 0:
        return False
    owed = 1 + stats.rounds // CLASSIC_SAMPLE_EVERY
    return stats.classic_samples < owed


def greedy_tokens(logits: mx.array) -> mx.array:
    """Classic decode's greedy token at every position of verify logits (1, W, V): the argmax of
    its log-probabilities, each computed on a (1, V) row exactly as a single step computes it."""
    return mx.concatenate([mx.argmax(log_probabilities(logits[:, i, :]), axis=-1)
                           for i in range(logits.shape[1])])


@dataclass(slots=True)
class PendingRound:
    """A round dispatched to the device and not yet read back."""

    width: int
    next_input: int
    drafts: mx.array
    verify: Verify
    accepted: mx.array | None
    """Sampled rounds: the accepted draft count, on device; greedy: None."""
    last: mx.array
    """Greedy: the target's argmax at every position; sampled: the round's final token."""
    started: float
    grammar_consumed: int = 0
    """Drafts the grammar's matcher consumed to mask the positions after them."""


class Burst:
    """One sequence's speculative decoding state: its drafter, the verify split, the acceptance rule."""

    def __init__(self, target: SpeculativeTarget, drafter: SequenceDrafter, split: Split,
                 sampler: SpeculativeSampler | None, probe: Probe | None = None,
                 processors: Sequence[Callable[[Any, Any], Any]] = ()) -> None:
        self.target = target
        self.drafter = drafter
        self.split = split
        self.sampler = sampler
        self.stats = BurstStats()
        self._probe = probe
        # The request's logits processors, in classic decode's order: a grammar (always last) masks
        # what the others computed, and is stateful, so it is driven apart from the pure ones.
        last = processors[-1] if processors else None
        self.grammar = last if isinstance(last, GrammarProcessor) else None
        self.processors = tuple(processors[:-1] if self.grammar is not None else processors)
        assert not any(isinstance(p, GrammarProcessor) for p in self.processors), "a grammar comes last"

    def start_round(self, cache: list[Any], next_input: int, width: int,
                    context: Sequence[int] = ()) -> PendingRound:
        """Dispatch one round of verify width *width* (K, or less near max_tokens); nothing is read back.

        *context*: every token before *next_input*, prompt included (what the
        logits processors read; unused by a request without any).
        """
        started = time.perf_counter()
        drafts = self.drafter.draft(width - 1).astype(mx.int32)
        if self._probe is not None:
            self._probe("verify")
        block = mx.concatenate([mx.array([[next_input]], dtype=mx.int32), drafts], axis=1)
        verify = self.target.verify(block, cache, self.split)
        logits, grammar_consumed = verify.logits, 0
        if self.processors or self.grammar is not None:
            logits, grammar_consumed = self._processed(logits, block, list(context))
        if self.sampler is None:
            accepted, last = None, greedy_tokens(logits)
            mx.async_eval(drafts, last)
        else:
            accepted, last = self.sampler(logits[0], drafts[0])
            mx.async_eval(drafts, accepted, last)
        return PendingRound(width, next_input, drafts, verify, accepted, last, started, grammar_consumed)

    def _processed(self, logits: mx.array, block: mx.array, context: list[int]) -> tuple[mx.array, int]:
        """Verify logits (1, W, V) with the processors applied at every position, and the drafts the
        grammar consumed.

        Position i predicts the token after ``context + block[:i+1]``: each
        processor gets that sequence and the position's (1, V) row, as a
        classic step calls it, so every processed row is the one classic
        decode would compute there, to the bit (given an exact verify).
        """
        masks: list[Any] = []
        grammar_consumed = 0
        if self.grammar is not None:
            # The masks need the drafts on the host: dispatch the verify first and compute them while it runs.
            mx.async_eval(block, logits)
            tokens: list[int] = block[0].tolist()  # type: ignore[assignment]
            masks, grammar_consumed = self.grammar.draft_masks([*context, tokens[0]], tokens[1:], logits.shape[-1])
        before = mx.array(context, dtype=mx.int32)
        rows = []
        for position in range(logits.shape[1]):
            row = logits[:, position, :]
            if self.processors:
                seen = mx.concatenate([before, block[0, :position + 1]])
                for processor in self.processors:
                    row = processor(seen, row)
            if position < len(masks):
                row = GrammarProcessor.apply(masks[position], row)
            rows.append(row)
        return mx.stack(rows, axis=1), grammar_consumed

    def finish_round(self, round_: PendingRound, cache: list[Any], count: bool = True) -> tuple[list[int], list[int]]:
        """Read back *round_*: (tokens the target kept, tokens emitted); caches rolled back to exactly those.

        The last emitted token is left unfed (the caller's next input). The
        round counts in :attr:`stats` (its wall time from dispatch) if *count*.
        """
        width = round_.width
        drafts: list[int] = round_.drafts[0].tolist()  # type: ignore[assignment]
        if round_.accepted is None:
            target_tokens: list[int] = round_.last.tolist()  # type: ignore[assignment]
            accepted = 0
            while accepted < width - 1 and drafts[accepted] == target_tokens[accepted]:
                accepted += 1
            last = target_tokens[accepted]
        else:
            accepted, last = int(round_.accepted.item()), int(round_.last.item())  # type: ignore[arg-type]
        fed = [round_.next_input, *drafts[:accepted]]
        emitted = [*drafts[:accepted], last]
        if self.grammar is not None:
            # Back to the drafts kept. More can be kept than consumed only from an end of sequence on: a
            # stopped matcher consumes nothing more, and the sequence ends there.
            self.grammar.rollback(max(0, round_.grammar_consumed - accepted))
        self.target.rollback(cache, round_.verify, kept=accepted + 1)
        self.drafter.accept(round_.verify.hidden[:, :accepted + 1], mx.array([emitted]), drafted=width - 1)
        if count:
            self.stats.rounds += 1
            self.stats.widths.add(1)
            self.stats.proposed += width - 1
            self.stats.accepted += accepted
            self.stats.round_seconds += time.perf_counter() - round_.started
        return fed, emitted
