"""Several engine channels read as one: the choices of an ``n > 1`` request, in the order events come."""

from __future__ import annotations

import math

import trio

from ..engine import Event


async def _forward(index: int, source: trio.MemoryReceiveChannel[Event],
                   sink: trio.MemorySendChannel[tuple[int, Event]]) -> None:
    with sink:
        try:
            async for event in source:
                sink.send_nowait((index, event))
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass  # the request ended (its cleanup closed the source, or nobody reads the sink)


def fan_in(channels: list[trio.MemoryReceiveChannel[Event]]) -> trio.MemoryReceiveChannel[tuple[int, Event]]:
    """One channel of ``(index, event)`` from *channels*; it ends when every one of them has ended.

    Each source is forwarded by a trio system task (a streamed body outlives
    the handler that could own a nursery). A forwarder ends when its source
    ends, is closed (the request's cleanup closes every source), or when the
    merged channel is closed; it never raises, so it cannot take the run down.
    The merged channel is unbounded, as the engine's own channels are: the
    engine never waits on a reader.
    """
    send, receive = trio.open_memory_channel[tuple[int, Event]](math.inf)
    with send:
        for index, source in enumerate(channels):
            trio.lowlevel.spawn_system_task(_forward, index, source, send.clone(), name=f"choice-{index}")
    return receive
