"""Placement and the policy reading, on plain values: no processes."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from mlxcel.router.placement import Placement
from mlxcel.router.policy_view import read_policy

SETTLED_ENABLE = {"schema_version": 1, "state": "settled", "reason": None, "verdict": "enable",
                  "mtp_enabled": True, "samples": 4}


@dataclass
class FakeNode:
    """A placement candidate: only the four values placement reads."""

    available: bool = True
    load: int = 0
    capacity: int | None = None
    runs_burst: bool = False


@pytest.mark.parametrize(("body", "readable", "state", "verdict", "burst"), [
    (SETTLED_ENABLE, True, "settled", "enable", True),
    ({**SETTLED_ENABLE, "verdict": "decline", "mtp_enabled": False}, True, "settled", "decline", False),
    # Unknown fields are ignored.
    ({**SETTLED_ENABLE, "future_field": {"x": 1}, "gpu_vendor": "Apple"}, True, "settled", "enable", True),
    # An unknown verdict label is no verdict, not an error.
    ({**SETTLED_ENABLE, "verdict": "enable_partially"}, True, "settled", None, False),
    # An unknown state label: no verdict, whatever else the body says.
    ({**SETTLED_ENABLE, "state": "settled_v2"}, True, None, None, False),
    # An unknown schema_version: unreadable, nothing used (even a body that would otherwise say enable).
    ({**SETTLED_ENABLE, "schema_version": 2}, False, None, None, False),
    ({**SETTLED_ENABLE, "schema_version": True}, False, None, None, False),
    ({**SETTLED_ENABLE, "schema_version": "1"}, False, None, None, False),
    ({k: v for k, v in SETTLED_ENABLE.items() if k != "schema_version"}, False, None, None, False),
    ([SETTLED_ENABLE], False, None, None, False),
    # An operator pin that resolved to on runs the burst; a pin to off and profiling do not.
    ({"schema_version": 1, "state": "forced", "verdict": None, "mtp_enabled": True}, True, "forced", None, True),
    ({"schema_version": 1, "state": "forced", "verdict": None, "mtp_enabled": False}, True, "forced", None, False),
    ({"schema_version": 1, "state": "profiling", "verdict": None, "mtp_enabled": True}, True, "profiling", None,
     False),
    # A verdict outside `settled` is not one.
    ({"schema_version": 1, "state": "unavailable", "reason": "a_new_reason", "verdict": "enable"}, True,
     "unavailable", None, False),
])
def test_the_policy_is_read_as_a_consumer_must(body: object, readable: bool, state: str | None,
                                               verdict: str | None, burst: bool) -> None:
    view = read_policy(body)
    assert (view.readable, view.state, view.verdict, view.runs_burst) == (readable, state, verdict, burst)


def test_an_idle_burst_node_takes_a_lone_request() -> None:
    nodes = [FakeNode(), FakeNode(runs_burst=True), FakeNode()]
    placement = Placement("mtp-aware")
    assert [placement.choose(nodes) for _ in range(4)] == [(1, "mtp_idle")] * 4


def test_other_traffic_is_kept_off_a_busy_burst_node() -> None:
    placement = Placement("mtp-aware")
    # The burst node is running a lone request: the next requests go to the others, least-loaded first,
    # even when the burst node is less loaded than they are.
    nodes = [FakeNode(load=2), FakeNode(load=1, runs_burst=True), FakeNode(load=3)]
    assert placement.choose(nodes) == (0, "least_loaded")
    # Until they have no free slot: then the least-loaded node of all.
    full = [FakeNode(load=2, capacity=2), FakeNode(load=1, runs_burst=True), FakeNode(load=4, capacity=4)]
    assert placement.choose(full) == (1, "overflow")


def test_without_a_burst_node_the_least_loaded_takes_it_and_ties_rotate() -> None:
    placement = Placement("mtp-aware")
    assert placement.choose([FakeNode(load=3), FakeNode(load=1), FakeNode(load=2)]) == (1, "least_loaded")
    idle = [FakeNode(), FakeNode(), FakeNode()]
    assert sorted(placement.choose(idle)[0] for _ in range(3)) == [0, 1, 2]  # type: ignore[index]


def test_unhealthy_and_already_tried_nodes_are_skipped() -> None:
    placement = Placement("mtp-aware")
    nodes = [FakeNode(available=False, runs_burst=True), FakeNode(load=5), FakeNode(load=1)]
    assert placement.choose(nodes) == (2, "least_loaded")
    assert placement.choose(nodes, exclude=frozenset({2})) == (1, "least_loaded")
    assert placement.choose(nodes, exclude=frozenset({1, 2})) is None
    assert placement.choose([]) is None


def test_round_robin_ignores_policy_and_load() -> None:
    placement = Placement("round-robin")
    nodes = [FakeNode(runs_burst=True), FakeNode(load=9), FakeNode(available=False)]
    assert [placement.choose(nodes) for _ in range(4)] == [
        (0, "round_robin"), (1, "round_robin"), (0, "round_robin"), (1, "round_robin")]
