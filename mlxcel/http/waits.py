"""Waits that trio does not spell in one call."""

from __future__ import annotations

import trio


async def first_of(*events: trio.Event) -> None:
    """Return once any of *events* is set."""
    async with trio.open_nursery() as nursery:
        async def wait(event: trio.Event) -> None:
            await event.wait()
            nursery.cancel_scope.cancel()
        for event in events:
            nursery.start_soon(wait, event)
