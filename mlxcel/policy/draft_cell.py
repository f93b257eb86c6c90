"""What the rule of K (:class:`~.draft_length.DraftLength`) keeps for one (batch width, context-depth band): the
step costs measured there, and where its choice stands. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass, field

#: Steps each K is measured for before the rule trusts its cost.
TRIALS = 2
#: Weight of the newest measurement in a cost's moving average.
COST_WEIGHT = 0.25
#: Steps a cell's first park lasts (each park after it doubles it, up to the rule's ``MAX_COOLDOWN``).
FIRST_COOLDOWN = 16


@dataclass(slots=True)
class Cell:
    """What one (width, band) has measured."""

    costs: dict[int, float] = field(default_factory=dict)
    """K -> moving average of a step's seconds (0: the classic step)."""
    samples: dict[int, int] = field(default_factory=dict)
    running: int = 0
    steps: int = 0
    """Steps chosen here since the last look at a neighbour of the K being run."""
    looked: int = 0
    """Which neighbour was looked at last (1: the larger K)."""
    looking: int = 0
    """The K of the last step here if it was not timed (0: it was, or none ran)."""
    looks: int = 0
    prior_taken: bool = False
    """:meth:`~.draft_length.DraftLength.choose`'s *parked_from* parked it once already."""
    retry: bool = False
    """A cooldown just ended: K = 1 is measured again even where the acceptance known says it cannot pay."""
    losses: int = 0
    parked_for: int = 0
    parked_yield: float = 0.0
    """Tokens the drafts were expected to add to a row at the most drafts when the cell last parked."""
    cooldown: int = FIRST_COOLDOWN
    deficit: float = 0.0
    """Tokens a row the speculative steps here made fewer of than classic steps would have (:data:`DEFICIT`)."""
    resume: tuple[int, float] | None = None
    """The best K measured when the cell parked, and the share of rows drafting: the park's first classic step's."""
    restored: set[int] = field(default_factory=set)
    """The Ks whose cost an earlier run or another width measured, used as measured until measured here: a
    verify's by :data:`TRIALS` trials, then averaged; the classic step's by its measurement (a borrowed width
    times it first, :meth:`~.draft_length.DraftLength._borrowed`)."""
    stale: set[int] = field(default_factory=set)
    """The Ks measured again after a cooldown, or by a look: their next measurement replaces what was known (after
    a cooldown, until then, each is judged by its cost before the park: :meth:`~.draft_length.DraftLength._may_pay`)."""
    borrowed: dict[int, float] = field(default_factory=dict)
    """K -> the cost another width measured (:meth:`~.draft_length.DraftLength._borrowed`), until trusted here: then a
    verify's cost here over its borrowed one rescales the verifies still only borrowed, so the verifies
    compared stay one width's (the classic step rescales none: it grows with the width otherwise)."""

    def add(self, k: int, seconds: float) -> None:
        restored = k in self.restored
        self.restored.discard(k)
        if restored and k > 0:
            self.samples[k] = 0
        old, count = self.costs.get(k), self.samples.get(k, 0)
        # A verify's trials keep the least: a new shape's first steps pay one-off costs (allocation, page faults) on
        # and off, and noise only adds (a step runs 4% under its K's median at the 10th percentile, 7-19% over at
        # the 90th). 8 rows' K = 3 took 0.69 and 0.91 s in its first two timed steps, 0.70-0.72 s run steadily.
        # The classic step's replace each other: its later runs are few while speculation runs, and a low
        # estimate of it parks speculation.
        if old is None or restored or k in self.stale or (k == 0 and count < TRIALS):
            self.costs[k] = seconds
        elif count < TRIALS:
            self.costs[k] = min(old, seconds)
        else:
            self.costs[k] = old + COST_WEIGHT * (seconds - old)
            if k > 0 and k == self.running:
                # The verifies not run are timed only by a look now and then, so a spell of a slower (or faster)
                # machine would show in the K run alone: its cost moved, theirs kept what they were timed at, and
                # the comparison moved with the machine, not the Ks. The verifies move with it (as a width's own
                # verify rescales its borrowed ones, below); a look times a K's own difference. The classic step
                # does not: it is re-timed when a park starts, and judged as timed then. (2 rows at 2k: K = 3 ran
                # 0.50-0.81 s for a spell against 0.41-0.45 s steady, and the rule ran K = 1 for the rest of the
                # round, docs/benchmarks.md, 2026-12-07.)
                factor = self.costs[k] / old
                for j in self.costs.keys() - {0, k}:
                    self.costs[j] *= factor
        if k in self.borrowed and count + 1 >= TRIALS:
            factor = self.costs[k] / self.borrowed.pop(k)
            if k > 0:
                for j in (self.restored & self.borrowed.keys()) - {0}:
                    self.costs[j] *= factor
        self.stale.discard(k)
        self.samples[k] = count + 1
