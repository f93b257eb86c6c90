"""Native calls off the event loop that a stopping server does not wait for, and the process does.

llguidance converts a schema and compiles a grammar in native code that cannot
be interrupted: tenths of a second to seconds for a large schema, and many at
once on a busy server. Once the server stops taking work, a request waiting on
one gets its 503 at once (after the compile it would get nothing else: the
engine takes no new work) instead of holding its connection past the graceful
shutdown's deadline and being cut without an answer; a client that goes away
stops waiting too. The thread is left to finish, still holding its place among
the :data:`NATIVE_THREADS` allowed at once, so requests that give up cannot
pile up native threads.
It cannot be left behind at exit, though: a daemon thread still in native code
when the interpreter finalizes takes the process down. So every call is counted
here and the process waits for the count to reach zero before it exits
(:func:`wait_for_native_calls`). No mlx here.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import trio

from ..http.errors import shutting_down
from .context import EngineApi

logger = logging.getLogger(__name__)

T = TypeVar("T")

NATIVE_THREADS = max(2, os.cpu_count() or 2)
"""Native calls at once: each is CPU-bound, so more threads than cores only add threads competing with the
event loop for the GIL between their native parts (and memory arenas that stay with the process)."""

_running = 0
"""Native calls started and not yet returned, in this process."""
_idle = threading.Condition()
_limiters: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("mlxcel_native_calls")
"""One limiter per trio run (as trio's own thread limiter): a call abandoned when its run ends keeps no place."""


def _limiter() -> trio.CapacityLimiter:
    try:
        return _limiters.get()
    except LookupError:
        limiter = trio.CapacityLimiter(NATIVE_THREADS)
        _limiters.set(limiter)
        return limiter


async def run_native(call: Callable[[], T], engine: EngineApi) -> T:
    """``call()`` on a thread of its own; its result or exception, or a 503 as soon as *engine* stops."""
    global _running
    limiter = _limiter()
    token = trio.lowlevel.current_trio_token()
    borrower = object()
    done = trio.Event()
    result: list[Any] = []  # the call's outcome (trio's ``outcome.Outcome``: a value or an exception)

    def returned() -> None:  # back in trio
        limiter.release_on_behalf_of(borrower)
        done.set()

    def report(outcome: Any) -> None:  # on the thread, after call()
        global _running
        result.append(outcome)
        with _idle:
            _running -= 1
            _idle.notify_all()
        with contextlib.suppress(trio.RunFinishedError):  # the server is gone: nothing to hand back
            token.run_sync_soon(returned)

    with engine.cancelled_on_stop():
        await limiter.acquire_on_behalf_of(borrower)
        with _idle:
            _running += 1
        trio.lowlevel.start_thread_soon(call, report, name="mlxcel native call")
        await done.wait()
        return result[0].unwrap()  # type: ignore[no-any-return]
    raise shutting_down()


def wait_for_native_calls(timeout: float | None = None) -> bool:
    """Block until no native call started by :func:`run_native` is running (True), or *timeout* passes (False)."""
    with _idle:
        if _running:
            logger.info("waiting for %d grammar compile(s) to end before exiting", _running)
        return _idle.wait_for(lambda: _running == 0, timeout)
