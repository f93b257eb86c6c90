"""SIGINT and SIGTERM as a graceful shutdown, for both roles' processes."""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable

import trio

logger = logging.getLogger(__name__)


async def until_signalled(serve: Callable[[trio.Event], Awaitable[None]]) -> None:
    """``serve(shutdown)``, with *shutdown* set by the first SIGINT or SIGTERM; returns when *serve* does."""
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        async def on_signals() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    logger.info("received %s: shutting down", signal.Signals(signum).name)
                    shutdown.set()
                    return

        nursery.start_soon(on_signals)
        await serve(shutdown)
        nursery.cancel_scope.cancel()
