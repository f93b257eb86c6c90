"""What a step of K drafts is expected to yield a row: the chance of each draft position, pooled over rows and Ks.

Pure Python. :class:`~.draft_length.DraftLength` reports each step's drafts kept, and asks for the tokens a row
yields at a K: E(K) = 1 + sum over k <= K of the product of the chances at positions j <= k. The chance at j is
that draft j is kept given drafts 1..j-1 were, over about the last twenty steps that drafted it (any K's: a K never
run is judged from the others' steps), fading while speculation is parked.

The chances depend on the K run: in a text that repeats, its hard token falls at the same draft position step after
step, and the draft a step drafts last read lowest under K = 2 and K = 3 alike (8 rows at depth 0: the second draft
kept 0.83 of the time while K = 2 ran, 0.945 while K = 3 ran). So a wider K judged from a narrower one's steps looks
worse than it is (3.21-3.25 tokens a row against its own 3.40). Judging each K by the tokens its own steps made was
tried and not kept: a step is one sample where rows share a text, and the few steps of a K not run locked the rule
on whichever drew lucky ones (docs/benchmarks.md, 2026-12-06, ninth).
"""

from __future__ import annotations

from collections.abc import Sequence

DECAY = 0.95
"""What is known of a position weighs this much less at every step that drafts it: about twenty such steps weigh
in. Rows that share a text keep or reject a draft together, so a step is one sample: over ten steps, two rejecting
ones parked 16 rows for good (docs/benchmarks.md, 2026-12-05)."""
FADED_ROWS = 8
"""Rows' worth a position keeps while speculation is parked (four times the prior's): a head known to fail is
judged at a tenth at most after a cooldown, and a look at a batch's rows outweighs what came before the park."""
#: Rows' worth of weight a draft position's prior (the chance at the position before it) carries.
PRIOR_ROWS = 2


class Acceptance:
    """The drafts' record, for steps of up to *max_drafts* drafts."""

    def __init__(self, max_drafts: int) -> None:
        self._tried = [0.0] * (max_drafts + 1)  # index j: draft j proposed with 1..j-1 kept (pooled)
        self._kept = [0.0] * (max_drafts + 1)

    @property
    def judged(self) -> bool:
        """Whether any draft was judged yet."""
        return self._tried[1] > 0

    def record(self, drafts: int, kept: Sequence[int]) -> None:
        """A step of *drafts* drafts a row ran; *kept*: each drafting row's leading drafts accepted."""
        self._fade(range(1, drafts + 1))  # only the positions this step drafted: the others keep what they knew
        for count in kept:
            for j in range(1, drafts + 1):
                self._tried[j] += 1
                if j <= count:
                    self._kept[j] += 1
                else:
                    break

    def parked(self) -> None:
        """A step parked: what was learnt fades (the traffic may have changed), to :data:`FADED_ROWS` rows' worth."""
        self._fade(range(1, len(self._tried)), FADED_ROWS)

    def position(self, j: int) -> float:
        """The pooled chance that draft *j* (1-based) is kept given the ones before it were: what was seen there,
        with :data:`PRIOR_ROWS` rows' worth of a prior, the chance at the position before (0.5 for the first: a
        Laplace estimate). A position seldom drafted is judged like the one before it, not as a coin toss (which
        held two rows on K = 2 where K = 3 paid 11% more); its own rows correct it within a few steps."""
        prior = 0.5 if j == 1 else self.position(j - 1)
        return (self._kept[j] + PRIOR_ROWS * prior) / (self._tried[j] + PRIOR_ROWS)

    def tokens(self, drafts: int, share: float = 1.0) -> float:
        """Tokens a row yields in a step of *drafts* drafts: its own, and the drafts expected kept; *share*: the
        fraction of the step's rows that draft (the others yield their own token alone)."""
        total, reach = 0.0, 1.0
        for j in range(1, drafts + 1):
            reach *= self.position(j)
            total += reach
        return 1.0 + share * total

    def _fade(self, positions: range, floor: float = 0.0) -> None:
        for j in positions:
            if self._tried[j] > floor:
                factor = max(DECAY, floor / self._tried[j])
                self._tried[j] *= factor
                self._kept[j] *= factor
