"""How many drafts to verify at each step, at every width (a lone request's burst is width 1), from measured costs.

Pure Python (no MLX, no clock): the engine reports what each step cost and how many drafts each row kept;
:meth:`DraftLength.choose` answers K for the next step, 0 meaning the untouched classic step. The rule (TurboSpec's
goodput, with the classic step measured directly, never as "speculation with no drafts"):

- before any draft was judged (costs restored at a start, acceptance not: it is the traffic's), the rule runs K = 1
  first rather than judge a K by a guessed acceptance (which would park a head that agrees), then, where the first
  draft agrees, the most drafts once;
- a step's cost is kept per (batch width, context-depth band, K): a verify's, the least of its first
  :data:`TRIALS` timed steps (a new shape's first steps pay one-off costs on and off), then an exponential moving
  average of its measured seconds;
- a row yields E(K) tokens at K, from the chance of each draft position j that draft j is kept given drafts
  1..j-1 were, pooled over rows and Ks, over about the last twenty steps that drafted it (:mod:`.acceptance`);
- a width not seen yet in a depth band starts from the costs of the nearest width measured in that band, each in use
  until measured here: the classic step first, by its own trials, the later kept, as at a width measured from
  nothing; a verify by trials of its own (its first step at a new width is a new shape and pays one-off costs);
  only costs measured at a width are persisted, and a restored verify is measured anew alike;
- the step picks the K that maximises width x E(K) / cost(K), against width / cost(0); a K not measured yet at this
  width and band is tried first (each for :data:`TRIALS` steps) once the classic step there is known, if it could
  pay at all: at the least it can cost (the dearest narrower step measured) and the acceptance known so far, it must
  beat every K measured there, the classic step included; K = 1 first while nothing is known of the drafts or the
  first is mostly rejected, else the most promising such K (the largest, where the drafts agree), so that once it
  has been measured the narrower ones, which can no longer win, are never run;
- it switches away from the K it runs only for a clear gain (:data:`SWITCH_GAIN`), and every :data:`LOOK_AROUND`
  steps measures a neighbouring K, so the costs it compares stay current (a step at more drafts than the step
  before it is not timed: it pays one-off costs), the look's timing replacing that K's cost; between looks the
  verifies not run move with the moving average of the K run (:meth:`.Cell.add`: a slower spell of the machine
  shows in the K run alone);
- when the classic step wins, or a K keeps losing to it as measured, and the steps run there have made
  :data:`DEFICIT` fewer tokens a row than classic steps would have in their time, speculation parks at that width
  and band for a cooldown that doubles with every park (up to :data:`MAX_COOLDOWN` steps) and resets once
  speculation wins again clearly (by :data:`SWITCH_GAIN`), or does not lose with drafts that agree more than when
  it parked (:data:`RISEN`); where it only ties, the looks after each cooldown are what it costs, and they grow
  rarer. Then K = 1 is measured once more, and each wider K that could pay at what it cost before the park, less
  a margin (:data:`STALE_COST`). The park's first classic step times the classic step again (nothing does while a
  K runs), and ends the park where the best K measured beats it as timed now.

The same rule decides for a lone request (width 1: the B=1 burst, round by round) once the policy lets the burst run
and is not profiling: the policy's verdict says whether the burst may run at all (the contract's B=1 verdict), this
says at which K, round by round, from the costs measured at width 1 and that depth (the profiling window's rounds
and classic steps are its first). The verdict's ``depth_limit`` (where the window's lines of round and step time
cross) is its prior: at that depth or deeper, a depth band where no speculative step was measured yet starts parked,
and is measured after the cooldown as any parked cell is. (A batch left with one row decodes at width 1 too: the
same physics, one row's verify against one row's step, the same cells.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from .acceptance import Acceptance
from .batch_view import BatchCell
from .cost_table import band_bounds, depth_band, read_table
from .draft_cell import FIRST_COOLDOWN, TRIALS, Cell

LOOK_AROUND = 32
"""Every this many steps at a K (sooner in a cell's first steps), a step at a neighbouring K keeps its cost
current; two at the larger, the first not timed (a step at more drafts than the step before it pays one-off costs:
1.5-2.2 s against 1.2 s at 16 rows, three drafts; docs/benchmarks.md, 2026-12-05, seventh)."""
#: Switch from the K being run only when another promises this much more throughput.
SWITCH_GAIN = 1.05
#: A speculative step slower than the classic step by this factor counts as a loss...
LOSS_MARGIN = 0.97
#: ... and this many losses in a row park speculation at that width and band.
PATIENCE = 4
#: A step that does not lose resets the cooldown when the drafts are expected to add this much more than when
#: the cell last parked (their acceptance has moved: the next look comes soon).
RISEN = 1.25
MAX_COOLDOWN = 4096
DEFICIT = 16.0
"""Tokens a row a cell's speculative steps must have made fewer of than classic steps would have in their time (net,
since last ahead: a CUSUM) before the estimates may park it. Rows of one text reject together, in bursts that drop the
acceptance below break-even while the steps stay ahead: 16 rows at 2k ran at 0.85 of always-on (docs/benchmarks.md,
2026-12-06). Seven rejecting steps at three drafts; a head that stops agreeing falls that far behind in as many."""
STALE_COST = 1.1
"""After a cooldown a K is measured again only where it could pay at its cost before the park over this: costs are
the machine's (10-15% apart run to run), what the drafts are worth is the traffic's. Measured again whatever it
cost, every K that loses paid a trial and a step up after every cooldown."""
#: Once the first draft is kept at least this often, the most promising K is tried first, not K = 1.
PROMISING = 0.5
MIN_DRAFT_YIELD = 0.1
"""Tokens a row's drafts must be expected to add to a step for its K to run at all: where a verify costs about
what a classic step does, a head that never agrees could edge past the classic step on a noisy clock."""


class DraftLength:
    """The per-step choice of K for a batch of *width* rows at context *depth*.

    *max_drafts*: the largest K (drafts per row; the verify is K + 1 wide).
    *forced*: always *max_drafts* (an operator's pin), still measuring.
    """

    def __init__(self, max_drafts: int, forced: bool = False, inexact: dict[int, str] | None = None) -> None:
        if max_drafts < 1:
            raise ValueError("max_drafts must be at least 1")
        self.max_drafts = max_drafts
        self.forced = forced
        self.inexact = dict(inexact or {})
        """Widths the exactness probe declined (width -> why): the classic step, pinned or not."""
        self._cells: dict[tuple[int, int], Cell] = {}
        self.acceptance = Acceptance(max_drafts)
        self._looked_deep = False  # whether a step drafted the most once the first draft was known to agree

    # -- what the engine reports -------------------------------------------------

    def classic(self, width: int, depth: int, seconds: float) -> None:
        """A classic step of *width* rows took *seconds*; the first while parked checks the park, which rested on
        the classic step as last timed (16 rows at 2k: 0.44 s, then 0.48-0.54 s in the same process, parked a K = 3
        that made 6% more; docs/benchmarks.md, 2026-12-06, sixteenth): the deficit was counted against that."""
        cell = self._cell(width, depth)
        cell.add(0, seconds)
        if cell.parked_for and cell.resume:
            (k, share), cell.resume = cell.resume, None
            cell.costs[0] = seconds  # timed now, not the reference the park rested on
            if self._yields(k, share) and self._rate(cell, k, share) > self._rate(cell, 0):
                cell.parked_for, cell.running, cell.deficit, cell.losses = 0, k, 0.0, 0
                cell.cooldown = max(FIRST_COOLDOWN, cell.cooldown // 2)

    def speculative(self, width: int, depth: int, drafts: int, seconds: float, kept: Sequence[int],
                    chosen: bool = True, timed: bool = True) -> None:
        """A step verifying *drafts* drafts for each of *width* rows took *seconds*; *kept*: each drafting row's
        leading drafts accepted (not the rows riding at K=0). Not *chosen* (a lone burst while the policy profiles):
        a loss does not park. Not *timed* (a step up: :data:`LOOK_AROUND`): only its acceptance counts."""
        cell = self._cell(width, depth)
        if timed:
            cell.add(drafts, seconds)
        cell.looking = 0 if timed else drafts
        self.acceptance.record(drafts, kept)
        classic = cell.costs.get(0)
        if classic is not None and chosen and timed:  # the tokens a row made against a classic step's in its time
            cell.deficit = max(0.0, cell.deficit + seconds / classic - 1 - sum(kept) / width)
        if classic is not None and kept and chosen and timed:
            # Losing: fewer tokens per second than the classic step, this step's time against the tokens a row
            # yields at this K by the pooled acceptance (one step's few rows would be noise).
            rate = self.expected_tokens(drafts, len(kept) / width) / seconds
            if rate < LOSS_MARGIN / classic:
                cell.losses += 1
                if cell.losses >= PATIENCE and cell.deficit >= DEFICIT:
                    self._park(cell, len(kept) / width)
            elif self._yields(drafts, len(kept) / width):  # a step that yields next to nothing is no success
                cell.losses = 0
                # A tie is no reason to look again sooner after a park (the acceptance worked out only if need be).
                if rate > SWITCH_GAIN / classic or \
                        self.expected_tokens(self.max_drafts) > 1 + RISEN * cell.parked_yield:
                    cell.cooldown = FIRST_COOLDOWN

    # -- the decision --------------------------------------------------------------

    def measuring_classic(self, width: int, depth: int) -> bool:
        """Whether the classic step at *width* and *depth* still has trials to run (its cost not trusted yet)."""
        cell = self._cells.get((width, depth_band(depth)))
        return cell is None or cell.samples.get(0, 0) < TRIALS

    def expected_tokens(self, drafts: int, share: float = 1.0) -> float:
        """Tokens a row yields in a step of *drafts* drafts (:meth:`.Acceptance.tokens`); *share*: the fraction of
        the step's rows that draft (the others yield their own token alone)."""
        return self.acceptance.tokens(drafts, share)

    def choose(self, width: int, depth: int, drafting: int | None = None, parked_from: int | None = None,
               measurable: bool = True) -> int:
        """K for the next step of *width* rows at context *depth* (0: the classic step), *drafting* of them
        able to draft (all, if not given: the others would ride along at K=0). *parked_from*: the depth from
        which speculation is estimated to lose (a lone request's ``depth_limit``): at that depth or deeper, a
        depth band where no speculative step was measured yet parks once, before anything is tried there.
        *measurable*: whether the step's cost will be reported (not when the rows just changed); one that will
        not runs the K of the nearest width settled (:meth:`_settled`), spending no trial or look."""
        if width in self.inexact:
            return 0
        if self.forced:
            return self.max_drafts
        share = 1.0 if drafting is None else drafting / width
        cell = self._cell(width, depth)
        if parked_from is not None and depth >= parked_from and not cell.prior_taken and \
                not any(k > 0 for k in cell.costs):
            cell.prior_taken = True  # once: after the cooldown this depth band is measured as any other
            self._park(cell, share)
        if cell.parked_for > 0:
            self.acceptance.parked()
            cell.parked_for -= 1
            if cell.parked_for == 0:  # the cooldown is over: each K is measured once more where it may pay
                # (:meth:`_may_pay`, from its cost before the park), and
                for k in range(1, self.max_drafts + 1):  # K = 1 in any case (the drafts' acceptance may have moved)
                    cell.samples[k] = min(cell.samples.get(k, 0), TRIALS - 1)
                    cell.stale.add(k)
                cell.retry = True
            return 0
        if not measurable:  # it teaches nothing: no trial or look is spent on it
            return self._settled(width, depth_band(depth))
        if cell.samples.get(0, 0) < TRIALS:  # the classic step is what everything is measured against
            return 0
        if cell.looking and self._yields(cell.looking, share):  # the last step here was not timed: its K again
            return cell.looking
        # Nothing judged of the drafts yet (costs restored at a start): look before judging any K by a guess at
        # their acceptance, K = 1 first, then, if the first is mostly kept, the deepest once (the later
        # positions' acceptance is known only from a step that drafts them).
        if not self.acceptance.judged:
            return 1
        if not self._looked_deep and self.acceptance.position(1) >= PROMISING:
            self._looked_deep = True
            return self.max_drafts
        trials = [k for k in range(1, self.max_drafts + 1)
                  if cell.samples.get(k, 0) < TRIALS and (self._may_pay(cell, k, share) or (k == 1 and cell.retry))]
        if trials:  # a trial: the K run (and published) stays what it was
            cell.retry = False
            if self.acceptance.position(1) < PROMISING:
                return min(trials)  # the drafts unknown, or mostly rejected: the cheapest look at them first
            return max(trials, key=lambda k: self.expected_tokens(k, share) / self._floor(cell, k))
        measured = [k for k in range(self.max_drafts + 1)
                    if cell.samples.get(k, 0) >= TRIALS and (k == 0 or self._yields(k, share))]
        best = max(measured, key=lambda k: self._rate(cell, k, share))
        if best == 0 and len(measured) > 1 and cell.deficit < DEFICIT:  # the steps made more than estimated
            best = max(measured[1:], key=lambda k: self._rate(cell, k, share))
        if cell.running not in measured or \
                self._rate(cell, best, share) > SWITCH_GAIN * self._rate(cell, cell.running, share):
            cell.running = best
        if cell.running == 0:  # classic wins here: look again after a cooldown, as after losses
            self._park(cell, share)
            return 0
        cell.steps += 1
        # The Ks not run go stale (and a cell's first measurements are its noisiest: a new shape's one-off
        # work): measure a neighbour of the K run, once, after 8 steps, then 16, then every LOOK_AROUND.
        if cell.steps >= min(LOOK_AROUND, 8 << cell.looks):
            cell.steps, cell.looks = 0, cell.looks + 1
            cell.looked = 1 - cell.looked
            neighbour = cell.running + (1 if cell.looked else -1)
            if 1 <= neighbour <= self.max_drafts and (neighbour in measured or self._may_pay(cell, neighbour, share)):
                cell.stale.add(neighbour)  # its cost is what the look times, not a blend with what it cost before
                return neighbour
        return cell.running

    def _settled(self, width: int, band: int) -> int:
        """The K run at the nearest width in *band* (*width* itself first) whose choice is settled: its classic step
        measured, and it parked (0) or runs a K; 0 where none is. A width met only while rows join or leave runs
        what its neighbours do now (held at what they ran when it was first met, it ran classic steps for good)."""
        settled = [(abs(w - width), w, cell) for (w, b), cell in self._cells.items()
                   if b == band and cell.samples.get(0, 0) >= TRIALS and (cell.parked_for or cell.running)]
        if not settled:
            return 0
        cell = min(settled, key=lambda entry: entry[:2])[2]
        return 0 if cell.parked_for else cell.running

    def _may_pay(self, cell: Cell, k: int, share: float = 1.0) -> bool:
        """Whether K could beat every K measured here (the classic step included) even at the least it can
        cost (after a park, its cost before it over :data:`STALE_COST`). What is known of the drafts' acceptance
        bounds what it can yield (a head that never agrees is not tried at every K; a narrower K is not tried once a
        wider one yields more than it ever could)."""
        if not self._yields(k, share):
            return False
        best = max(self._rate(cell, j, share) for j in range(self.max_drafts + 1)
                   if cell.samples.get(j, 0) >= TRIALS and (j == 0 or self._yields(j, share)))
        least = self._floor(cell, k)
        if k in cell.stale and k in cell.costs:  # measured before the park: costs move less than the drafts' worth
            least = max(least, cell.costs[k] / STALE_COST)
        return self.expected_tokens(k, share) / least > SWITCH_GAIN * best

    @staticmethod
    def _floor(cell: Cell, k: int) -> float:
        """The least a step at K can cost: a wider verify never costs less than a narrower one measured, nor
        than the classic step."""
        return max(cost for j, cost in cell.costs.items() if j < k)

    def _yields(self, k: int, share: float) -> bool:
        """Whether K's drafts are expected to add at least :data:`MIN_DRAFT_YIELD` tokens a row."""
        return self.expected_tokens(k, share) - 1 >= MIN_DRAFT_YIELD

    def _park(self, cell: Cell, share: float) -> None:
        measured = [k for k in range(1, self.max_drafts + 1) if cell.samples.get(k, 0) >= TRIALS]
        best = max(measured, key=lambda k: self._rate(cell, k, share)) if measured and 0 in cell.costs else 0
        cell.resume = (best, share) if best else None
        cell.parked_for, cell.losses, cell.running, cell.looking = cell.cooldown, 0, 0, 0
        cell.parked_yield = self.expected_tokens(self.max_drafts) - 1
        cell.cooldown = min(MAX_COOLDOWN, cell.cooldown * 2)

    def _rate(self, cell: Cell, k: int, share: float = 1.0) -> float:
        return self.expected_tokens(k, share) / cell.costs[k]

    def _cell(self, width: int, depth: int) -> Cell:
        key = (width, depth_band(depth))
        cell = self._cells.get(key)
        if cell is None:
            cell = self._cells[key] = self._borrowed(*key)
        return cell

    def _borrowed(self, width: int, band: int) -> Cell:
        """A new cell, holding the costs of the nearest width measured in its band as if restored: rows join
        and leave a batch all the time, and a width measured from nothing would run every K it tries before it
        pays. Its first steps are classic, :data:`TRIALS` of them as at a new width, the later kept (classic steps
        grow more slowly with the width than verifies: a borrowed one would misjudge every K; one step's timing is
        one draw: 16 rows at 2k timed a first 7-16% over the later ones), then the K its neighbour runs, timed from
        its second step (the first is a step up). Paid once per width and band on a machine: costs persist."""
        near = [(abs(w - width), w) for (w, b), cell in self._cells.items() if b == band and 0 in cell.costs]
        cell = Cell()
        if near:
            source = self._cells[(min(near)[1], band)]
            for k, seconds in source.costs.items():
                cell.costs[k], cell.samples[k] = seconds, TRIALS
            cell.samples[0] = 0  # the classic step measured here first: what every K is judged against
            cell.restored, cell.borrowed = set(cell.costs), dict(cell.costs)
            cell.running = source.running
        return cell

    def cells(self) -> tuple[BatchCell, ...]:
        """Per width and depth band measured, the K run there and its estimated speedup."""
        out = []
        for (width, band), cell in sorted(self._cells.items()):
            k = self.max_drafts if self.forced else 0 if cell.parked_for else cell.running
            measured = 0 in cell.costs and k in cell.costs
            speedup = self._rate(cell, k) / self._rate(cell, 0) if measured else None
            out.append(BatchCell(width, *band_bounds(band), k,
                                 None if speedup is None or not math.isfinite(speedup) else round(speedup, 2)))
        return tuple(out)

    def export(self) -> dict[str, object]:
        """The measured step costs, to persist (acceptance is the traffic's, not the machine's: not kept)."""
        return {"max_drafts": self.max_drafts,
                "cells": [{"width": width, "band": band,
                           "seconds": {str(k): v for k, v in sorted(cell.costs.items()) if k not in cell.borrowed}}
                          for (width, band), cell in sorted(self._cells.items())]}

    def restore(self, table: object) -> str | None:
        """Take the step costs of *table* (from :meth:`export`) as measured; why not, when they do not fit
        (then nothing is taken: :func:`~.cost_table.read_table`)."""
        cells = read_table(table, self.max_drafts)
        if isinstance(cells, str):
            return cells
        for key, costs in cells.items():
            cell = self._cells[key] = Cell()
            for k, seconds in costs.items():
                cell.costs[k], cell.samples[k] = seconds, TRIALS
                cell.restored.add(k)
        return None
