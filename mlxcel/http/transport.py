"""ASGI middleware between hypercorn and the quart-trio app: responses that keep the connection sound.

Two things go wrong with quart-trio on hypercorn without it:

- **Hypercorn's bookkeeping is cancelled.** Hypercorn finishes a response
  (recycles a keep-alive connection, starts its idle timer, closes a
  ``Connection: close`` or HTTP/1.0 connection) inside the app's call to
  ``send`` for the last body chunk. quart-trio runs the request in a nursery
  whose message reader cancels that nursery as soon as it receives
  ``http.disconnect``, and hypercorn delivers that message from within the same
  ``send``. The rest of hypercorn's work is then cancelled half-way: idle
  connections are never timed out and closing connections are never closed.
  Shielding the app's ``send`` lets hypercorn finish; hypercorn already shields
  the socket write itself, so nothing new can block under the shield except
  the bounded wait below.
- **Answers before the body is read** (401, 404, 405, 413) leave unread body
  bytes on a keep-alive connection. When the app starts such a response, the
  guard waits (bounded in bytes and time) for the rest of the body, which
  quart's message reader is already consuming, so the connection can carry the
  next request; if the body is over the limit (declared, or as a chunked body
  arrives) or too slow, it adds ``Connection: close`` instead, so client and
  server agree the connection ends. A stopping server does not wait (nor
  goes on waiting once it stops): the connection ends with the graceful
  shutdown, and the wait would hold the answer (a 503 to a body still
  arriving) until the graceful period ran out.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import trio

from .waits import first_of

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]

def _declared_length(scope: Scope) -> int | None:
    """The request's Content-Length; 0 without a body; None for a body of unknown length (chunked)."""
    length: int | None = 0
    for name, value in scope.get("headers", ()):
        if name.lower() == b"transfer-encoding":
            return None
        if name.lower() == b"content-length":
            try:
                length = int(value)
            except ValueError:
                return None  # h11 rejects these before the app; be safe anyway
    return length


class _Body:
    """What the app has received of the request body so far."""

    def __init__(self, declared: int | None) -> None:
        self.declared = declared
        self.received = 0
        self.changed = trio.Event()
        self.complete = declared == 0
        self.disconnected = False

    def saw(self, message: Message) -> None:
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            self.complete = self.complete or not message.get("more_body", False)
        elif message["type"] == "http.disconnect":
            self.disconnected = True
        self.changed.set()
        self.changed = trio.Event()

    def _oversized(self, limit: int) -> bool:
        return self.received > limit or (self.declared is not None and self.declared > limit)

    async def reusable(self, limit: int, seconds: float, stopping: trio.Event) -> bool:
        """Whether the connection can carry another request after this answer: the server is not stopping, the
        whole body has arrived (waiting for it, bounded, and not past a stop), and it is not over *limit* (then
        the answer always closes, whether or not the rest happened to arrive)."""
        with trio.move_on_after(seconds):
            while not (self.complete or self.disconnected or self._oversized(limit) or stopping.is_set()):
                await first_of(self.changed, stopping)
        return self.complete and not self._oversized(limit) and not stopping.is_set()


def guard_transport(app: Any, *, drain_limit: int, drain_seconds: float, stopping: trio.Event) -> Asgi:
    """Wrap *app* (see the module docstring).

    An early answer waits for at most *drain_limit* bytes of body and *drain_seconds*
    (the server passes ``--max-body-bytes`` and the keep-alive timeout: as long as
    it would wait for an idle client); once *stopping* is set, for none, and a wait
    under way ends.
    """

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        body = _Body(_declared_length(scope))

        async def tracked_receive() -> Message:
            message = await receive()
            body.saw(message)
            return message

        async def shielded_send(message: Message) -> None:
            with trio.CancelScope(shield=True):
                if message["type"] == "http.response.start" \
                        and not await body.reusable(drain_limit, drain_seconds, stopping):
                    message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
                await send(message)

        await app(scope, tracked_receive, shielded_send)

    return guarded
