"""Which models make room, and which are idle too long: model-free."""

from __future__ import annotations

from mlxcel.fleet.residency import Resident, idle_too_long, next_idle_deadline, to_unload_for_one_more


def _r(name: str, last_used: float, *, pinned: bool = False, busy: bool = False,
       idle: float | None = None) -> Resident:
    return Resident(name, pinned, busy, last_used, idle)


def test_room_is_made_least_recently_used_first_among_idle_unpinned_models() -> None:
    residents = [_r("a", 5.0), _r("b", 1.0, pinned=True), _r("c", 3.0), _r("d", 2.0, busy=True)]
    assert to_unload_for_one_more(residents, None) == []
    assert to_unload_for_one_more(residents, 5) == []
    assert to_unload_for_one_more(residents, 4) == ["c"]  # b is older but pinned, d older but busy
    assert to_unload_for_one_more(residents, 3) == ["c", "a"]
    assert to_unload_for_one_more(residents, 2) is None  # only two can go: wait for d


def test_a_pinned_or_busy_model_is_never_unloaded_for_idleness() -> None:
    residents = [_r("a", 0.0, idle=10.0), _r("b", 0.0, idle=10.0, pinned=True), _r("c", 0.0, idle=10.0, busy=True),
                 _r("d", 5.0, idle=10.0), _r("e", 0.0)]
    assert idle_too_long(residents, 9.9) == []
    assert idle_too_long(residents, 10.0) == ["a"]
    assert idle_too_long(residents, 15.0) == ["a", "d"]
    assert next_idle_deadline(residents) == 10.0
    assert next_idle_deadline([_r("e", 0.0), _r("b", 0.0, idle=1.0, pinned=True)]) is None
