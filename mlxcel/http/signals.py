"""SIGINT and SIGTERM as a graceful shutdown, for both roles' processes; a second one stops without waiting."""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable

import trio

logger = logging.getLogger(__name__)


async def until_signalled(serve: Callable[[trio.Event], Awaitable[None]]) -> None:
    """``serve(shutdown)``, with *shutdown* set by the first SIGINT or SIGTERM; returns when *serve* does.

    A second signal cancels *serve*: what its graceful shutdown still waits for (connections in the graceful
    period) is abandoned. A turn the MLX worker is in (a prefill chunk) still ends first: native code cannot be
    interrupted. The receiver stays installed until *serve* returns or a second signal comes, so neither of the
    first two becomes a KeyboardInterrupt (a third may: :func:`interrupted` tells the command line so).
    """
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        async def on_signals() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    name = signal.Signals(signum).name
                    if not shutdown.is_set():
                        logger.info("received %s: shutting down (another signal stops without waiting)", name)
                        shutdown.set()
                    else:
                        logger.warning("received %s again: stopping without waiting for open answers", name)
                        nursery.cancel_scope.cancel()

        nursery.start_soon(on_signals)
        await serve(shutdown)
        nursery.cancel_scope.cancel()


def first_error(exc: BaseException) -> BaseException:
    """*exc*, or the first error of an exception group (trio's nurseries wrap what ends a served process)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def interrupted(exc: BaseException) -> bool:
    """Whether *exc* is a KeyboardInterrupt, bare or first in an exception group."""
    return isinstance(first_error(exc), KeyboardInterrupt)
