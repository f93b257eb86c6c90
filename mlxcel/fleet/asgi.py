"""The raw ASGI the fleet's front speaks before it hands a request to a model's app: the lifespan, a body read
and replayed, its ``model``, a JSON answer of its own, and a stream begun while the model loads."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from ..engine.stopping import Stopping
from ..http.errors import ApiError, anthropic_body, shutting_down

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]



def header(scope: Scope, name: str) -> str | None:
    """The request's header *name* (lower case), or None."""
    wanted = name.encode("latin-1")
    return next((v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == wanted), None)


#: A stream whose model is not loaded gets its head and a first keep-alive after this many seconds of waiting...
PING_AFTER = 1.0
#: ... and one every this many after that.
PING_EVERY = 5.0
#: Bodies up to this many bytes are parsed for their ``model`` on the event loop; larger ones on a thread.
INLINE_PARSE = 1 << 16


async def lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


async def read_body(receive: Receive, limit: int) -> tuple[list[dict[str, Any]], bool]:
    """The request's body messages as read, and whether that is all of it (not when it outgrows *limit*, when
    given, or the client left: the default app then answers from the replay)."""
    messages: list[dict[str, Any]] = []
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages, False
        size += len(message.get("body", b""))
        if limit and size > limit:
            return messages, False
        if not message.get("more_body", False):
            return messages, True


async def read_body_unless_stopped(scope: Scope, receive: Receive, send: Send, limit: int,
                                   stopping: Stopping) -> tuple[list[dict[str, Any]], bool] | None:
    """:func:`read_body`'s answer; or None, once this has answered 503 itself because the server stopped before
    the body had all arrived (as one model's server does: waiting for the rest could outlast the graceful period,
    and the connection would close with no answer)."""
    read = None
    with stopping.cancelled():
        read = await read_body(receive, limit)
    if read is None:
        await send_error(send, scope, shutting_down(body_unread=True))
    return read


def replaying(messages: list[dict[str, Any]], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> dict[str, Any]:
        return pending.pop(0) if pending else await receive()
    return replay


async def model_named(body: bytes) -> tuple[str | None, bool]:
    """A request body's ``model``, when it is a JSON object naming one as a string (else None: the app that answers
    finds what is wrong with it), and whether it asks for a stream. Also the router's."""
    try:
        parsed = json.loads(body) if len(body) <= INLINE_PARSE else await trio.to_thread.run_sync(json.loads, body)
    except ValueError:
        return None, False
    if not isinstance(parsed, dict):
        return None, False
    model = parsed.get("model")
    return (model if isinstance(model, str) else None), parsed.get("stream") is True


class PingedStream:
    """A server-sent-event answer begun by the front while the request's model loads: its head, then
    keep-alives; the app's own answer is then written into it (:meth:`send`)."""

    def __init__(self, send: Send, anthropic: bool) -> None:
        self._send = send
        self._anthropic = anthropic
        self.started = False
        self._status = 200
        self._held = b""

    async def ping_while_waiting(self) -> None:
        await trio.sleep(PING_AFTER)
        self.started = True
        await self._send({"type": "http.response.start", "status": 200,
                          "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        while True:
            ping = b'event: ping\ndata: {"type":"ping"}\n\n' if self._anthropic else b": ping\n\n"
            await self._send({"type": "http.response.body", "body": ping, "more_body": True})
            await trio.sleep(PING_EVERY)

    async def send(self, message: dict[str, Any]) -> None:
        """The app's answer, into the stream already begun: its head dropped, its events passed on; an error it
        answers with (a JSON body, not a stream) written as the route's error event."""
        if message["type"] == "http.response.start":
            self._status = message["status"]
            return
        if message["type"] != "http.response.body" or self._status == 200:
            await self._send(message)
            return
        self._held += message.get("body", b"")
        if not message.get("more_body", False):
            try:
                body = json.loads(self._held)
            except ValueError:
                body = {"error": {"message": self._held.decode("utf-8", "replace"), "type": "server_error"}}
            await self._event(body)

    async def fail(self, error: ApiError) -> None:
        await self._event(anthropic_body(error) if self._anthropic else error.body())

    async def _event(self, body: dict[str, Any]) -> None:
        data = json.dumps(body, separators=(",", ":"))
        event = f"event: error\ndata: {data}\n\n" if self._anthropic else f"data: {data}\n\n"
        await self._send({"type": "http.response.body", "body": event.encode(), "more_body": False})


async def send_error(send: Send, scope: Scope, error: ApiError) -> None:
    """*error* in the shape of the API asked (Anthropic's on its routes, else OpenAI's)."""
    anthropic = scope["path"] == "/v1/messages" or scope["path"].startswith("/v1/messages/")
    await send_json(send, error.status, anthropic_body(error) if anthropic else error.body())


async def send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
