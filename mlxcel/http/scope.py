"""The per-request scope: cleanups that run when the ASGI call for a request returns, however it ends.

A streamed response's body generator cannot be relied on for that: when the
client leaves before Quart starts iterating it, the generator never starts
and its ``finally`` never runs. Both roles (a serving node, a router) wrap
their app in :class:`RequestScope` (:func:`mlxcel.http.app.create_app`).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_cleanups: contextvars.ContextVar[list[Callable[[], None]]] = contextvars.ContextVar("mlxcel_request_cleanups")


def at_request_end(cleanup: Callable[[], None]) -> None:
    """Run *cleanup* when this HTTP request's ASGI call returns: sent, failed, or cancelled.

    Registering has no checkpoint, so nothing can come between the action it
    undoes and the registration. Without a scope (the app is not wrapped by
    :class:`RequestScope`) this is an error: a cleanup that never runs is a leak.
    """
    _cleanups.get().append(cleanup)


class RequestScope:
    """ASGI middleware that gives every HTTP request a list of cleanups, run when its call returns.

    The list is set in a context variable before the app runs; quart-trio's
    request tasks are spawned from this task, so they see the same list.
    """

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        cleanups: list[Callable[[], None]] = []
        token = _cleanups.set(cleanups)
        try:
            await self.app(scope, receive, send)
        finally:
            _cleanups.reset(token)
            for cleanup in cleanups:
                try:
                    cleanup()
                except Exception:  # one failed cleanup must not skip the others
                    logger.exception("a request cleanup failed")
