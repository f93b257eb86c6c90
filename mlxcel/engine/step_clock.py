"""What each batch step cost, for the rule of K: the step's own work, not what the steps around it left.

MLX evaluates lazily, and mlx-lm's classic step is pipelined: it queues the next
step's forward, then waits for the last one's tokens. Timed one by one, a
classic step's seconds are its predecessor's forward, and a step after one of
the other kind pays what that one left: the first classic step after a
speculative one waits for its own forward, the second for nothing, and the
speculative step after a classic run for the run's last forward. A step whose
rows changed pays, once, for reshaping the batch's caches (a row that joined
merged in, the rows that left filtered out): seconds, at 16 rows over 2k
tokens of context. Averaged in as a K's cost, one such step held the rule on a
narrower K for the rest of a request.

So :class:`StepClock`:

- times the classic steps the rule may learn from as runs, as the lone burst
  does (:mod:`.burst_loop`): the work in flight done before the first, then
  the time each step waits, and the last one's forward done, over the steps.
  A run ends within its step at :data:`RUN_STEPS` steps, after each step while
  the rule still measures the classic step there, and when the batch is left
  empty (its last forward would otherwise run while the server idles, and
  count as nothing); else at the next step that is not one of its kind.
  Ending a run costs one step's overlap of building the next forward with the
  device's work. (A pipelined step's device work during the worker's handling
  of the tokens between steps is not counted: that handling is paid whatever
  K runs.)
- starts a speculative step's clock with the work in flight done
  (:meth:`~.batch_speculation.BatchSpeculation.step` ends with its own done);
- measures no step whose rows are not the rows the step before began with;
- reports a speculative step at more drafts than the step before it as not
  timed (its acceptance counts, its cost does not): mlx's CPU backend
  allocates every buffer per step and glibc hands big blocks back to the
  kernel, so a step that needs bigger ones than the last takes them back a
  page fault at a time, 3-25% more at 16 rows (docs/benchmarks.md,
  2026-12-05, seventh).

Pure Python (no MLX, no clock of its own): waiting for the device is the caller's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..policy.cost_table import depth_band

if TYPE_CHECKING:
    from ..policy.draft_length import DraftLength

logger = logging.getLogger(__name__)

#: A run of classic steps is reported (one cost: its seconds over its steps) after this many.
RUN_STEPS = 8


@dataclass(slots=True)
class _Run:
    width: int
    depth: int
    seconds: float = 0.0
    steps: int = 0


class StepClock:
    """The batch's step costs, reported to *rule*; *finish* waits for the work queued on the device (the
    batch's last forward); *clock*: seconds."""

    def __init__(self, rule: DraftLength, finish: Callable[[], None],
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._rule = rule
        self._finish = finish
        self._clock = clock
        self._rows: list[int] | None = None
        self._run: _Run | None = None
        self._started = 0.0
        self._drafts = 0  # the last step's drafts per row (0: a classic step)
        self._step_up = False  # the speculative step timed now has more drafts than the step before it

    def begin(self, rows: Sequence[int], depth: int) -> bool:
        """A step of *rows* (the batch's uids, in order) at *depth* begins: whether its cost will be its own
        (the rows the last step began with: none joined, none left). Ends a classic run that this step cannot
        join: rows changed, another depth band."""
        steady = self._rows == list(rows)
        self._rows = list(rows)
        run = self._run
        if run is not None and (not steady or depth_band(depth) != depth_band(run.depth)):
            self.end_run()
        return steady

    def classic(self, width: int, depth: int, measured: bool = True) -> None:
        """A classic step is about to run. One the rule may learn from (*measured*: it chose it, on the rows the
        step before began with, no prompt waiting) joins the run (one begins, the work in flight done first, if
        none runs), and :meth:`classic_done` follows; another ends the run."""
        self._drafts = 0
        if not measured:
            self.end_run()
            return
        if self._run is None:
            self._finish()
            self._run = _Run(width, depth)
        self._run.steps += 1
        self._started = self._clock()

    def classic_done(self, rows_left: int) -> None:
        """The classic step :meth:`classic` announced is done, *rows_left* rows in the batch after it."""
        run = self._run
        assert run is not None
        run.seconds += self._clock() - self._started
        most = 1 if self._rule.measuring_classic(run.width, run.depth) else RUN_STEPS
        if rows_left == 0 or run.steps >= most:
            self.end_run()

    def end_run(self) -> None:
        """Report the classic run, if one runs: its last forward done, its seconds over its steps. Before any
        step that is not one of the run's."""
        run, self._run = self._run, None
        if run is None:
            return
        started = self._clock()
        self._finish()
        seconds = (run.seconds + self._clock() - started) / run.steps
        self._rule.classic(run.width, run.depth, seconds)
        logger.debug("step: %d rows at depth %d, classic, %.4f s a step over %d", run.width, run.depth, seconds,
                     run.steps)

    def forget(self) -> None:
        """The batch was rebuilt (a step failed): no run to report, no rows to compare with, no step before."""
        self._rows, self._run, self._drafts = None, None, 0

    def start(self, drafts: int) -> None:
        """A speculative step of *drafts* drafts per row begins: the classic run reported (which waits for the
        work in flight), or else the work in flight done, its clock started."""
        if self._run is not None:
            self.end_run()
        else:
            self._finish()
        self._step_up, self._drafts = drafts > self._drafts, drafts
        self._started = self._clock()

    def speculative_done(self, width: int, depth: int, kept: Sequence[int], steady: bool) -> None:
        """The speculative step :meth:`start` began is done (its own work waited for); *kept*: each drafting
        row's drafts accepted; *steady*: what :meth:`begin` answered. Reported to the rule if *steady*, timed
        unless it was a step up."""
        seconds = self._clock() - self._started
        if steady:
            self._rule.speculative(width, depth, self._drafts, seconds, kept, timed=not self._step_up)
        logger.debug("step: %d rows at depth %d, %d drafts, %.4f s%s, kept %s", width, depth, self._drafts, seconds,
                     " (rows changed: not measured)" if not steady else
                     " (more drafts than the step before: not timed)" if self._step_up else "", kept)
