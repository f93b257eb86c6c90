"""The memory budget's ledger: reservations, waiting for room, and giving it back (trio's virtual clock)."""

from __future__ import annotations

import trio

from mlxcel.server.memory import MemoryLedger


async def test_a_reservation_waits_for_room_and_gets_it_when_another_ends(autojump_clock: trio.abc.Clock) -> None:
    ledger = MemoryLedger(100)
    ledger.charge("model", 40)
    assert ledger.try_reserve("a", 50) and ledger.free == 10
    got: list[tuple[bool, float]] = []

    async def second() -> None:
        got.append((await ledger.reserve("b", 30, wait=60), trio.current_time()))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(second)
        await trio.sleep(5)
        assert got == [] and ledger.reserved == 50
        ledger.release("a")
    assert got == [(True, 5.0)] and ledger.to_json() == {"budget": 100, "charged": 40, "reserved": 30, "free": 30}
    ledger.release("a")  # twice: nothing
    assert ledger.reserved == 30


async def test_a_reservation_that_never_fits_gives_up_at_its_bound(autojump_clock: trio.abc.Clock) -> None:
    ledger = MemoryLedger(100)
    ledger.charge("model", 90)
    assert not await ledger.reserve("a", 20, wait=3)
    assert trio.current_time() == 3.0 and ledger.reserved == 0
    ledger.uncharge("model")  # a model unloaded makes room
    assert await ledger.reserve("a", 20, wait=3) and ledger.free == 80


async def test_a_reservation_that_does_not_fit_asks_for_room_first(autojump_clock: trio.abc.Clock) -> None:
    ledger = MemoryLedger(100)
    ledger.charge("idle", 60)
    asked: list[int] = []

    async def make_room(count: int) -> None:
        asked.append(count)
        ledger.uncharge("idle")  # as a server of several models unloads an idle one

    ledger.make_room = make_room
    assert await ledger.reserve("a", 70, wait=1) and asked == [30] and trio.current_time() == 0.0
