"""Which serving node takes a request: pure Python, no I/O.

``mtp-aware`` (the default) is the placement only mlxcel can do, because only
mlxcel nodes publish whether a lone request there runs the B=1 MTP burst:

1. an idle node whose policy runs the burst (``PolicyView.runs_burst``) takes
   the request, which will then decode alone there, with the burst
   (reason ``mtp_idle``);
2. otherwise the least-loaded node that is *not* a burst node and has a free
   slot (when its slot count is known) takes it, so the other traffic is packed
   onto nodes that gain nothing from being alone and the burst nodes stay idle
   for the next lone request (``least_loaded``);
3. otherwise the least-loaded node of all (``overflow``).

``least-loaded`` is step 3 alone and ``round-robin`` takes the healthy nodes in
turn; both ignore the policy (the benchmark's baselines). Ties are broken by a
rotating start, so equal nodes share the traffic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

PlacementMode = Literal["mtp-aware", "least-loaded", "round-robin"]
PLACEMENT_MODES: tuple[PlacementMode, ...] = ("mtp-aware", "least-loaded", "round-robin")
#: Every reason a decision can be counted under in /router/stats.
REASONS = ("mtp_idle", "least_loaded", "overflow", "round_robin")


class Candidate(Protocol):
    """What placement reads of a node."""

    @property
    def available(self) -> bool: ...

    @property
    def load(self) -> int: ...

    @property
    def capacity(self) -> int | None: ...

    @property
    def runs_burst(self) -> bool: ...


class Placement:
    """Chooses a node for each request; keeps only the rotation that breaks ties."""

    def __init__(self, mode: PlacementMode = "mtp-aware") -> None:
        self.mode = mode
        self._last = -1
        """The node chosen last: the search starts after it, so nodes take turns."""

    def choose(self, nodes: Sequence[Candidate], exclude: frozenset[int] = frozenset()) -> tuple[int, str] | None:
        """The index of the node to try and the reason, or None when no node can be tried.

        *exclude* holds the indices already tried for this request.
        """
        choice = self._choose(nodes, exclude)
        if choice is not None:
            self._last = choice[0]
        return choice

    def _choose(self, nodes: Sequence[Candidate], exclude: frozenset[int]) -> tuple[int, str] | None:
        count = len(nodes)
        # Every node once, starting after the last one chosen: ties go to the earliest in this order.
        order = [(self._last + 1 + k) % count for k in range(count)]
        usable = [i for i in order if i not in exclude and nodes[i].available]
        if not usable:
            return None
        if self.mode == "round-robin":
            return usable[0], "round_robin"
        if self.mode == "mtp-aware":
            idle_burst = [i for i in usable if nodes[i].runs_burst and nodes[i].load == 0]
            if idle_burst:
                return idle_burst[0], "mtp_idle"
            roomy = [i for i in usable if not nodes[i].runs_burst and _has_room(nodes[i])]
            if roomy:
                return _least_loaded(nodes, roomy), "least_loaded"
            return _least_loaded(nodes, usable), "overflow"
        return _least_loaded(nodes, usable), "least_loaded"


def _has_room(node: Candidate) -> bool:
    return node.capacity is None or node.load < node.capacity


def _least_loaded(nodes: Sequence[Candidate], indices: list[int]) -> int:
    return min(indices, key=lambda i: nodes[i].load)  # min keeps the first of equals: the rotation's
