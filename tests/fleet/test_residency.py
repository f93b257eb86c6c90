"""Which models make room, and which are idle too long: model-free."""

from __future__ import annotations

from mlxcel.fleet.residency import Resident, charge, idle_too_long, next_idle_deadline, size, to_unload_for

GB = 1 << 30


def _r(name: str, last_used: float, *, pinned: bool = False, busy: bool = False, idle: float | None = None,
       size: int = 0) -> Resident:
    return Resident(name, pinned, busy, last_used, idle, size)


def test_room_by_count_is_made_least_recently_used_first_among_idle_unpinned_models() -> None:
    residents = [_r("a", 5.0), _r("b", 1.0, pinned=True), _r("c", 3.0), _r("d", 2.0, busy=True)]
    assert to_unload_for(residents, 0, None, None) == []
    assert to_unload_for(residents, 0, None, 5) == []
    assert to_unload_for(residents, 0, None, 4) == ["c"]  # b is older but pinned, d older but busy
    assert to_unload_for(residents, 0, None, 3) == ["c", "a"]
    assert to_unload_for(residents, 0, None, 2) is None  # only two can go: wait for d


def test_room_by_bytes_unloads_only_as_many_as_the_new_model_needs() -> None:
    residents = [_r("a", 1.0, size=4 * GB), _r("b", 2.0, size=2 * GB), _r("c", 3.0, size=6 * GB),
                 _r("p", 0.0, size=3 * GB, pinned=True)]
    assert to_unload_for(residents, 1 * GB, 16 * GB, None) == []  # 15 of 16 used
    assert to_unload_for(residents, 4 * GB, 16 * GB, None) == ["a"]  # oldest first, and that is enough
    assert to_unload_for(residents, 7 * GB, 16 * GB, None) == ["a", "b"]
    assert to_unload_for(residents, 13 * GB, 16 * GB, None) == ["a", "b", "c"]  # the pinned 3 GB stay
    assert to_unload_for(residents, 14 * GB, 16 * GB, None) is None
    assert to_unload_for(residents, 1 * GB, 16 * GB, 3) == ["a", "b"]  # both bounds at once
    assert to_unload_for([_r("x", 0.0, size=GB, busy=True)], GB, GB, None) is None  # wait for it


def test_a_model_is_charged_its_weights_its_drafter_and_its_prefix_cache_bound() -> None:
    assert charge(5 * GB, GB // 2, 2 * GB) == 7 * GB + GB // 2


def test_a_pinned_or_busy_model_is_never_unloaded_for_idleness() -> None:
    residents = [_r("a", 0.0, idle=10.0), _r("b", 0.0, idle=10.0, pinned=True), _r("c", 0.0, idle=10.0, busy=True),
                 _r("d", 5.0, idle=10.0), _r("e", 0.0)]
    assert idle_too_long(residents, 9.9) == []
    assert idle_too_long(residents, 10.0) == ["a"]
    assert idle_too_long(residents, 15.0) == ["a", "d"]
    assert next_idle_deadline(residents) == 10.0
    assert next_idle_deadline([_r("e", 0.0), _r("b", 0.0, idle=1.0, pinned=True)]) is None


def test_sizes_read_as_people_write_them() -> None:
    assert [size(n) for n in (512, 812_000, 1_048_576, 1_650_000, 24 * 10**9, 123 * 10**9)] == [
        "512 B", "812 kB", "1.05 MB", "1.65 MB", "24 GB", "123 GB"]
