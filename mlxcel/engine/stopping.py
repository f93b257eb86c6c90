"""A server's stop as the waits before a submit see it: :class:`Stopping` (trio thread only)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import trio


class Stopping:
    """Whether an engine is closing, and the cancel scopes its stop cancels."""

    def __init__(self) -> None:
        self.closing = False
        self._scopes: set[trio.CancelScope] = set()

    def close(self) -> None:
        """Closing from now on; every wait inside :meth:`cancelled` ends."""
        self.closing = True
        for scope in self._scopes:
            scope.cancel()

    @contextlib.contextmanager
    def cancelled(self) -> Iterator[trio.CancelScope]:
        """A cancel scope that a stop cancels (at once, if closing already): around a wait whose result a stopping
        server can no longer use (a request's body, a grammar compile before its submit)."""
        scope = trio.CancelScope()
        if self.closing:
            scope.cancel()
        self._scopes.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._scopes.discard(scope)
