"""The B=1 burst's round loop for a lone request, and its classic-decode timing while profiling.

Worker thread only; family-agnostic (the rounds come from :mod:`.burst`).
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from .burst import CLASSIC_SAMPLE_STEPS, classic_sample_due
from .output import SequenceOutput
from .solo import SoloDecoder


def run_burst(solo: SoloDecoder, output: SequenceOutput, block_size: int, profiling: bool,
              mail: Callable[[], bool], emit: Callable[[list[int]], bool]) -> None:
    """Speculative rounds until the sequence finishes (*emit* says so) or *mail* arrives (then it parks).

    Pipelined like classic decode: the next round is dispatched before this
    round's tokens are handled (detokenised, checked, delivered), so that work
    overlaps the device's. No round is dispatched past end of sequence or
    ``max_tokens``, nor with mail waiting. A round in flight when the sequence
    finishes (a stop string) is read back and dropped by the worker.

    While *profiling*, classic decode is timed here and now, in the same state:
    :data:`~.burst.CLASSIC_SAMPLE_STEPS` pipelined single-token steps after the
    first round and every few rounds after (real tokens of the answer), so that
    every sample the policy gets carries a classic timing beside its rounds.
    """
    assert solo.burst is not None
    stats = solo.burst.stats

    def sample_due() -> bool:
        return profiling and classic_sample_due(stats)

    def round_next(remaining: int, tokens: list[int]) -> bool:
        return (remaining > 1 and solo.can_draft and not sample_due() and not mail()
                and output.eos_tokens.isdisjoint(tokens))

    def handle(token: int) -> bool:
        return emit([token])

    while True:
        if not solo.round_in_flight:
            if mail():
                return
            trio.from_thread.check_cancelled()
            remaining = output.remaining
            if sample_due() and remaining >= CLASSIC_SAMPLE_STEPS:
                if solo.classic_steps(CLASSIC_SAMPLE_STEPS, True, handle):
                    return
                continue
            if not round_next(remaining, []):  # the last token, nothing to draft from yet, a sample too late
                if solo.classic_steps(1, False, handle):
                    return
                continue
            solo.start_round(min(block_size, remaining))
        tokens = solo.finish_round()
        left = output.remaining - len(tokens)
        if round_next(left, tokens):
            solo.start_round(min(block_size, left))
        if emit(tokens):
            return
