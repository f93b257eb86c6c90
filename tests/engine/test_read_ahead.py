"""Arrivals held while their disk entries are read: each rule of :mod:`mlxcel.engine.read_ahead`, without a
model, with real futures and the real scheduler behind it (written out by hand for each case, as
tests/engine/test_scheduler.py does)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from mlxcel.engine.messages import Cancel, ReadDone, Stop, Submit
from mlxcel.engine.read_ahead import ReadAhead
from mlxcel.engine.scheduler import Scheduler
from tests.engine.test_scheduler import BATCH4, submit


class Reads:
    """The reads started, by request id; "cached" and "none" stand for a read done already and nothing to read."""

    def __init__(self) -> None:
        self.started: dict[str, Future[Any]] = {}
        self.wakes = 0

    def read(self, arrival: Any) -> Future[Any] | None:
        if arrival.id.startswith("none"):
            return None
        future: Future[Any] = Future()
        if arrival.id.startswith("cached"):
            future.set_result((None, None))
        self.started[arrival.id] = future
        return future

    def wake(self) -> None:
        self.wakes += 1


def test_an_arrival_whose_entry_is_being_read_waits_and_the_others_go_on() -> None:
    reads = Reads()
    ahead = ReadAhead(reads.read, reads.wake)
    passed, ended = ahead.sort([*submit("disk", "none", "cached")])
    assert [m.request.id for m in passed if isinstance(m, Submit)] == ["none", "cached"] and ended == []
    assert len(ahead) == 1 and reads.wakes == 0
    assert ahead.sort([]) == ([], [])  # still reading
    reads.started["disk"].set_result((None, None))
    assert reads.wakes == 1  # from the reader's thread, in the server: the worker's inbox gets a ReadDone
    passed, ended = ahead.sort([ReadDone(), *submit("later")])
    assert [m.request.id for m in passed if isinstance(m, Submit)] == ["disk"]  # "later" is read now
    assert ended == [] and len(ahead) == 1


def test_arrivals_read_together_pass_on_in_the_order_they_came() -> None:
    reads = Reads()
    ahead = ReadAhead(reads.read, reads.wake)
    ahead.sort([*submit("a", "b", "c")])
    for name in ("c", "a"):
        reads.started[name].set_result((None, None))
    passed, _ = ahead.sort([ReadDone(), ReadDone()])
    assert [m.request.id for m in passed if isinstance(m, Submit)] == ["a", "c"]


def test_a_cancel_ends_a_held_arrival_here_and_the_scheduler_never_sees_it() -> None:
    reads = Reads()
    ahead = ReadAhead(reads.read, reads.wake)
    scheduler = Scheduler(BATCH4)
    passed, ended = ahead.sort([*submit("disk"), Cancel("disk"), *submit("none")])
    intake = scheduler.take(passed)
    assert [r.id for r, _ in intake.admitted] == ["none"] and intake.finished == [] and intake.cancelled == []
    assert [(request_id, f.reason, f.prompt_tokens, f.error) for request_id, f in ended] == \
        [("disk", "cancelled", 3, "the client went away")]
    passed, ended = ahead.sort([Cancel("disk")])  # the engine's second cancel of it: nothing held, nothing ended
    assert ended == [] and scheduler.take(passed).cancelled == []
    reads.started["disk"].set_result((None, None))  # the read still ends; its wake-up finds nothing to pass
    assert ahead.sort([ReadDone()]) == ([], []) and scheduler.held == 1


def test_a_stop_ends_the_held_arrivals_with_the_stops_error() -> None:
    reads = Reads()
    ahead = ReadAhead(reads.read, reads.wake)
    scheduler = Scheduler(BATCH4)
    scheduler.take(ahead.sort([*submit("none")])[0])
    ahead.sort([*submit("disk")])
    passed, ended = ahead.sort([Stop("server shutting down"), *submit("after")])
    intake = scheduler.take(passed)
    assert ended == [] and len(ahead) == 0
    assert intake.stop == "server shutting down"
    assert [(request_id, f.reason, f.error) for request_id, f in intake.finished] == \
        [("disk", "error", "server shutting down")]

