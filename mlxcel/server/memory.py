"""What a server holds against ``--memory-budget``: each loaded model's charge, and each request's reservation for
the caches of its sequences at the length they may reach. Trio thread only (the fleet's front and the routes).

A request reserves before its sequences are submitted and gives its reservation back when it ends: a new
sequence is admitted only if its cache at its reach fits beside everything else, so memory never outgrows the
budget by the sequences' growth. One that does not fit waits for room, up to its bound.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from ..fleet.residency import size
from ..http.errors import unavailable
from ..http.scope import at_request_end


class MemoryLedger:
    """The budget, the models charged against it, and the requests' reservations."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._models: dict[str, int] = {}
        self._requests: dict[str, int] = {}
        self._changed = trio.Event()
        self.make_room: Callable[[int], Awaitable[None]] | None = None
        """Set by a server of several models: unload idle models until this many more bytes are free (or none
        is left to unload); what a reservation that does not fit asks first."""

    @property
    def charged(self) -> int:
        """What the loaded models are charged (weights, drafters, prefix cache bounds)."""
        return sum(self._models.values())

    @property
    def reserved(self) -> int:
        """What the requests in flight have reserved for their sequences' caches."""
        return sum(self._requests.values())

    @property
    def free(self) -> int:
        return self.budget - self.charged - self.reserved

    def charge_of(self, model: str) -> int:
        """What *model* is charged (0: not loaded)."""
        return self._models.get(model, 0)

    def charge(self, model: str, count: int) -> None:
        self._models[model] = count

    def uncharge(self, model: str) -> None:
        if self._models.pop(model, None) is not None:
            self._wake()

    def try_reserve(self, request: str, count: int) -> bool:
        """Reserve *count* bytes for *request*, if they fit now."""
        if count > self.free:
            return False
        self._requests[request] = self._requests.get(request, 0) + count
        return True

    async def reserve(self, request: str, count: int, wait: float) -> bool:
        """Reserve *count* bytes for *request*, waiting up to *wait* seconds for room; whether it got them."""
        if self.try_reserve(request, count):
            return True
        with trio.move_on_after(wait):
            if self.make_room is not None:
                await self.make_room(count - self.free)
            while not self.try_reserve(request, count):
                await self._changed.wait()
            return True
        return False

    def release(self, request: str) -> None:
        """*request* has ended: its reservation is free again (a second call does nothing)."""
        if self._requests.pop(request, None) is not None:
            self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def to_json(self) -> dict[str, int]:
        return {"budget": self.budget, "charged": self.charged, "reserved": self.reserved, "free": self.free}


async def reserve(ledger: MemoryLedger, request: str, need: int, model: str, wait: float) -> None:
    """Room for *need* bytes of a request's sequences' caches, held until the request ends (a route's call): a 503
    ``insufficient_memory`` at once when *need* is more than the budget leaves beside *model* (not even with every
    other model unloaded and no other request in flight), else after *wait* seconds without room."""
    at_request_end(lambda: ledger.release(request))
    room = ledger.budget - ledger.charge_of(model)
    if need > room:
        raise unavailable(f"this request's sequences may hold {size(need)} of cache, more than the memory budget "
                          f"leaves beside this model ({size(room)}); ask for fewer tokens or choices",
                          "insufficient_memory")
    if not await ledger.reserve(request, need, wait):
        raise unavailable(f"no room for this request's {size(need)} of cache within the memory budget after "
                          f"{wait:g} s; retry later", "insufficient_memory")
