"""What the batch's steps cost, as the rule of K is told, model-free: a simulated device that runs queued work
in order, driven the way ``ContinuousBatch.step`` drives it (mlx-lm's classic step queues its forward, then
waits for the last one's tokens; a speculative step waits for its own work)."""

from __future__ import annotations

import pytest

from mlxcel.engine.step_clock import RUN_STEPS, StepClock
from mlxcel.policy.cost_table import FIRST_BAND_TOKENS
from mlxcel.policy.draft_length import TRIALS, DraftLength

CLASSIC, VERIFY = 0.10, 0.25  # the device's seconds for a classic forward and a speculative step (K = 2)


class Device:
    """Work queued runs in order after whatever runs; the host's clock moves only while it waits."""

    def __init__(self) -> None:
        self.now = 0.0
        self.free = 0.0  # when the queued work is done
        self.last_forward = 0.0  # when the classic forward queued last is done

    def finish(self) -> None:
        self.now = max(self.now, self.free)

    def classic_step(self) -> None:
        """mlx-lm's pipelined step: queue this forward, wait for the last one's."""
        waited_for = self.last_forward
        self.free = self.last_forward = max(self.now, self.free) + CLASSIC
        self.now = max(self.now, waited_for)

    def speculative_step(self) -> None:
        self.finish()
        self.now += VERIFY
        self.free = self.now


class Recorder(DraftLength):
    def __init__(self) -> None:
        super().__init__(3)
        self.classics: list[tuple[int, int, float]] = []
        self.speculatives: list[float] = []
        self.timed: list[bool] = []

    def classic(self, width: int, depth: int, seconds: float) -> None:
        self.classics.append((width, depth, seconds))
        super().classic(width, depth, seconds)

    def speculative(self, width: int, depth: int, drafts: int, seconds: float, kept: object,
                    chosen: bool = True, timed: bool = True) -> None:
        self.speculatives.append(seconds)
        self.timed.append(timed)
        super().speculative(width, depth, drafts, seconds, [2, 2], chosen, timed)


def drive(pattern: str, rule: Recorder | None = None, rows: list[int] | None = None, depth: int = 100,
          device: Device | None = None) -> tuple[Recorder, StepClock, Device]:
    """Steps *pattern* (C: a classic step the rule may learn from, c: one it may not, S: a speculative one at two
    drafts, 1 or 3: at that many) on the same rows."""
    rule = rule or Recorder()
    device = device or Device()
    clock = StepClock(rule, device.finish, lambda: device.now)
    rows = rows or [1, 2]
    for kind in pattern:
        steady = clock.begin(rows, depth)
        if kind in "Cc":
            clock.classic(len(rows), depth, measured=kind == "C")
            device.classic_step()
            if kind == "C":
                clock.classic_done(len(rows))
        else:
            clock.start(2 if kind == "S" else int(kind))
            device.speculative_step()
            clock.speculative_done(len(rows), depth, [2, 2], steady)
        depth += 1
    clock.end_run()
    return rule, clock, device


def test_each_step_is_charged_its_own_work_whatever_ran_before_it() -> None:
    # Timed one by one, the first classic step after a speculative one read 0.1 s (its own forward), the second
    # nothing, and the speculative step after a classic run 0.35 s (the run's last forward and its own).
    rule, _, device = drive("CC" + "SCSCCSCCCSCCCCS" + "C" * 20 + "S")
    assert [seconds for _, _, seconds in rule.classics] == pytest.approx([CLASSIC] * len(rule.classics))
    assert rule.speculatives == pytest.approx([VERIFY] * 6)
    assert rule.timed == [False] * 6  # each came after a classic step: a step up
    classic_steps = sum(steps == "C" for steps in "CC" + "SCSCCSCCCSCCCCS" + "C" * 20 + "S")
    assert device.now == pytest.approx(classic_steps * CLASSIC + 6 * VERIFY)  # nothing was run twice or lost


def test_a_classic_run_is_one_cost_at_most_run_steps_long_once_the_rule_knows_the_classic_step() -> None:
    rule, _, _ = drive("C" * (TRIALS + 2 * RUN_STEPS + 3))
    assert len(rule.classics) == TRIALS + 3  # the trials one by one, two full runs, the rest when it ended
    assert all(seconds == pytest.approx(CLASSIC) for _, _, seconds in rule.classics)


def test_a_step_whose_rows_changed_is_not_measured_and_ends_the_run() -> None:
    device, rule = Device(), Recorder()
    clock = StepClock(rule, device.finish, lambda: device.now)
    assert clock.begin([1, 2], 100) is False  # nothing to compare with yet
    for _ in range(TRIALS + 3):
        assert clock.begin([1, 2], 100) is True
        clock.classic(2, 100)
        device.classic_step()
        clock.classic_done(2)
    reported = len(rule.classics)
    assert clock.begin([1, 2, 3], 100) is False  # a row joined: its cache is merged into the batch's now
    assert len(rule.classics) == reported + 1  # the run that was going on, reported before this step
    assert rule.classics[-1][2] == pytest.approx(CLASSIC)
    assert clock.begin([1, 3], 100) is False  # one left
    assert clock.begin([1, 3], 100) is True


def test_a_run_is_reported_at_a_new_depth_band() -> None:
    start = FIRST_BAND_TOKENS - TRIALS - 3  # the trials, then a run of three steps that the band's end cuts
    rule, _, _ = drive("C" * (TRIALS + 3 + 2), depth=start)
    depths = [depth for _, depth, _ in rule.classics]
    assert depths == [*range(start, start + TRIALS), start + TRIALS, FIRST_BAND_TOKENS, FIRST_BAND_TOKENS + 1]


def test_time_away_from_the_batch_is_not_a_steps_cost() -> None:
    """The worker's other turns (a lone request's burst) between two steps, and an idle server after the step
    that emptied the batch, cost the batch's steps nothing."""
    rule, device = Recorder(), Device()
    drive("C" * (TRIALS + 2), rule, device=device)
    clock = StepClock(rule, device.finish, lambda: device.now)
    clock.begin([1, 2], 200)
    reported = len(rule.classics)
    for _ in range(3):
        assert clock.begin([1, 2], 200)
        clock.classic(2, 200)
        device.classic_step()
        clock.classic_done(2)
        device.now += 5.0  # another turn: its work is the host's here, the forward queued runs meanwhile
    assert clock.begin([1, 2], 200)
    clock.classic(2, 200)
    device.classic_step()
    clock.classic_done(0)  # the last rows finished: the run is reported now, not after the idle time to come
    assert len(rule.classics) == reported + 1
    assert rule.classics[-1][2] <= CLASSIC


def test_a_rebuilt_batch_reports_nothing_of_the_run_that_failed() -> None:
    device, rule = Device(), Recorder()
    clock = StepClock(rule, device.finish, lambda: device.now)
    clock.begin([1], 10)
    clock.classic(1, 10)
    device.classic_step()
    clock.forget()
    clock.end_run()
    assert rule.classics == []
    assert clock.begin([1], 10) is False


def test_a_step_at_more_drafts_than_the_step_before_it_is_reported_not_timed() -> None:
    """Its buffers are bigger than the last step's, and glibc gave those back: it pays page faults once. A step at
    as many drafts or fewer is timed, a classic step counts as none, and so does one the rule may not learn from."""
    rule, _, _ = drive("C" * TRIALS + "1" + "1" + "3" + "3" + "S" + "3" + "c" + "1" + "C" + "S")
    assert rule.timed == [False, True, False, True, True, False, False, False]
