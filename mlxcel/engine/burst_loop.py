"""The B=1 burst's loop for a lone request: rounds and classic steps, K chosen round by round.

Worker thread only; family-agnostic (the rounds come from :mod:`.burst`). While
the policy profiles, every round drafts the most it can (profiling forces MTP
on) and classic decode is timed beside the rounds; otherwise the rule of K
(:class:`~mlxcel.policy.draft_length.DraftLength` at width 1, the same rule the
batch's steps ask) picks each round's drafts, 0 meaning a classic step, from the
costs measured at width 1 and this depth. Every round and classic step is
reported to it, so that its width-1 costs stay current.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from .burst import CLASSIC_SAMPLE_STEPS, classic_sample_due
from .output import SequenceOutput
from .solo import SoloDecoder
from .step_clock import RUN_STEPS

if TYPE_CHECKING:
    from ..policy.draft_length import DraftLength

# A run of classic steps inside the burst ends (its cost reported, its request's cancellation checked) after
# RUN_STEPS (the batch's runs', engine/step_clock.py): ending a run costs one step's overlap with its token's
# handling...
#: ... or this many while the rule still measures the classic step (a new depth band: it then tries a K sooner).
MEASURING_STEPS = 2


def run_burst(solo: SoloDecoder, output: SequenceOutput, block_size: int, profiling: bool,
              mail: Callable[[], bool], emit: Callable[[list[int]], bool],
              rule: DraftLength | None = None, parked_from: int | None = None,
              counted: Callable[[int, int], None] = lambda drafts, steps: None) -> None:
    """Rounds and classic steps until the sequence finishes (*emit* says so) or *mail* arrives (then it parks).

    Pipelined like classic decode: the next round (or step) is dispatched before
    this one's tokens are handled (detokenised, checked, delivered), so that work
    overlaps the device's. No round is dispatched past end of sequence or
    ``max_tokens``, nor with mail waiting. A round in flight when the sequence
    finishes (a stop string) is read back and dropped by the worker.

    While *profiling*, every round is *block_size* wide and classic decode is
    timed here and now, in the same state: :data:`~.burst.CLASSIC_SAMPLE_STEPS`
    pipelined single-token steps after the first round and every few rounds after
    (real tokens of the answer), so that every sample the policy gets carries a
    classic timing beside its rounds. Otherwise *rule* chooses each round's drafts
    (*parked_from*: the verdict's depth limit, its prior); without one, every round
    drafts the most it can. *counted* (drafts, steps) hears of every round and
    classic step (drafts 0), for ``/metrics``.
    """
    assert solo.burst is not None
    stats = solo.burst.stats
    decided: int | None = None  # a choice the rule made for the next step, not acted on yet

    def sample_due() -> bool:
        return profiling and classic_sample_due(stats)

    def depth() -> int:
        return len(solo.tokens_in_cache)

    def drafts_next(remaining: int, tokens: list[int]) -> int:
        """The drafts of the next round (0: a classic step), *remaining* tokens allowed after *tokens*."""
        nonlocal decided
        if remaining <= 1 or not solo.can_draft or sample_due() or mail() or not output.eos_tokens.isdisjoint(tokens):
            return 0
        if decided is None:
            decided = block_size - 1 if profiling or rule is None else rule.choose(1, depth(), parked_from=parked_from)
        return min(decided, remaining - 1)

    def handle(token: int) -> bool:
        return emit([token])

    def classic_run() -> bool:
        """Pipelined classic steps while the next one is a classic step too (at most :data:`RUN_STEPS`, or
        :data:`MEASURING_STEPS`); True when the sequence finished. Their time is reported as one cost, from
        the first dispatch to the last token read: a read-back can wait for the step queued behind it too, so
        the times between read-backs do not count one step each (:meth:`~.solo.SoloDecoder.classic_steps`)."""
        nonlocal decided
        decided = None
        started, at = time.perf_counter(), depth()
        # While the rule still measures the classic step here, a run is each of its trials: two steps, timed.
        most = MEASURING_STEPS if rule is not None and rule.measuring_classic(1, at) else RUN_STEPS

        def more(read: int) -> bool:
            nonlocal decided
            left = output.remaining - 1  # after the token about to be read
            if left >= 1 and read < most and not mail() and drafts_next(left, []) == 0:
                decided = None  # the rule's 0 is acted on: this step is fed now
                return True
            return False

        finished, steps = solo.classic_run(more, handle)
        if not finished and rule is not None:
            rule.classic(1, at, (time.perf_counter() - started) / steps)
        counted(0, steps)
        return finished

    while True:
        if not solo.round_in_flight:
            if mail():
                return
            trio.from_thread.check_cancelled()
            remaining = output.remaining
            if sample_due() and remaining >= CLASSIC_SAMPLE_STEPS:
                started, at, before = time.perf_counter(), depth(), output.generated
                finished = solo.classic_steps(CLASSIC_SAMPLE_STEPS, True, handle)
                counted(0, output.generated - before)
                if finished:
                    return
                if rule is not None:
                    rule.classic(1, at, (time.perf_counter() - started) / CLASSIC_SAMPLE_STEPS)
                continue
            drafts = drafts_next(remaining, [])
            if drafts == 0:  # the rule's classic step, the last token, nothing to draft from yet, a sample too late
                if classic_run():
                    return
                continue
            decided = None
            started, at = time.perf_counter(), depth()
            solo.start_round(drafts + 1)
        tokens = solo.finish_round()
        if rule is not None:
            rule.speculative(1, at, drafts, time.perf_counter() - started, [len(tokens) - 1], chosen=not profiling)
        counted(drafts, 1)
        drafts = drafts_next(output.remaining - len(tokens), tokens)
        if drafts:
            decided = None
            started, at = time.perf_counter(), depth()
            solo.start_round(drafts + 1)
        if emit(tokens):
            return
