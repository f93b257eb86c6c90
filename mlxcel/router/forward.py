"""Forwarding one generation request to a serving node, with retry before the first byte.

Each request's backend side runs as one task in the router's nursery, under its
own cancel scope, and talks to the route handler over an unbuffered memory
channel: first a :class:`Head` (or the :class:`~mlxcel.server.errors.ApiError`
to answer with), then the body's chunks as the node sends them, so a stream
passes through chunk by chunk and nothing is buffered. The handler registers
the scope's ``cancel`` with :func:`~mlxcel.server.context.at_request_end`:
however the client's request ends (finished, disconnected before or during the
stream, even before Quart starts the body) the backend request is closed, and
the serving node cancels its generation.

A node that fails on the transport before its first body byte reached the
router (refused, reset, killed mid-generation of a non-streamed answer) is
marked unhealthy and the request is tried on another node; so is a node that
answers 503 (loading, at capacity, shutting down), without being marked. Once
the first byte is passed on, the answer is committed to that node: a failure
after it ends the client's stream (with an error event on an SSE stream, and no
``[DONE]``, as a serving node that goes away mid-stream does).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import trio

from ..server.errors import ApiError, unavailable
from .nodes import Node, _describe
from .placement import Placement

logger = logging.getLogger(__name__)

#: Request headers passed on to a node. The client's own credentials are never passed on.
FORWARDED_REQUEST_HEADERS = ("content-type", "accept")
#: Response headers passed back to the client (hop-by-hop and framing headers are the router's own).
FORWARDED_RESPONSE_HEADERS = ("content-type", "cache-control")


@dataclass(frozen=True, slots=True)
class Head:
    """A node's answer has begun: its status and the headers passed back."""

    status: int
    headers: dict[str, str]
    node: str


class MidStreamFailure:
    """The node failed after the answer was committed to it."""


MID_STREAM_FAILURE = MidStreamFailure()


class Forwarder:
    """Places and forwards requests; counts the decisions for /router/stats."""

    def __init__(self, nodes: list[Node], placement: Placement, client: httpx.AsyncClient,
                 backend_headers: dict[str, str]) -> None:
        self.nodes = nodes
        self.placement = placement
        self.client = client
        self.backend_headers = backend_headers
        self.decisions: Counter[str] = Counter()
        self.rerouted = 0
        self.rejected = 0

    async def open(self, nursery: trio.Nursery, path: str, body: bytes, headers: dict[str, str],
                   ) -> tuple[trio.CancelScope, trio.MemoryReceiveChannel[object]]:
        """Start forwarding; the scope that ends it and the channel its head and chunks arrive on."""
        send, receive = trio.open_memory_channel[object](0)
        scope = trio.CancelScope()
        outgoing = {k: v for k, v in headers.items() if k.lower() in FORWARDED_REQUEST_HEADERS}
        nursery.start_soon(self._run, scope, send, path, body, {**outgoing, **self.backend_headers})
        return scope, receive

    async def _run(self, scope: trio.CancelScope, send: trio.MemorySendChannel[object], path: str, body: bytes,
                   headers: dict[str, str]) -> None:
        with scope:
            async with send:
                try:
                    await self._forward(send, path, body, headers)
                except trio.BrokenResourceError:
                    pass  # the handler is gone; the scope is being cancelled too
                except Exception:  # never take the router down: this request ends, the others go on
                    logger.exception("forwarding %s failed", path)

    async def _forward(self, send: trio.MemorySendChannel[object], path: str, body: bytes,
                       headers: dict[str, str]) -> None:
        tried: set[int] = set()
        busy: ApiError | None = None
        while True:
            choice = self.placement.choose(self.nodes, frozenset(tried))
            if choice is None:
                self.rejected += 1
                await send.send(busy or unavailable("no serving node can take this request now; retry later",
                                                    "no_backend"))
                return
            index, reason = choice
            if tried:
                self.rerouted += 1
            tried.add(index)
            self.decisions[reason] += 1
            node = self.nodes[index]
            node.in_flight += 1  # no checkpoint since choose(): the next request's choice sees it
            try:
                outcome = await self._attempt(send, node, path, body, headers)
            finally:
                node.in_flight -= 1
            if isinstance(outcome, ApiError):
                busy = outcome
                continue
            if outcome:
                return

    async def _attempt(self, send: trio.MemorySendChannel[object], node: Node, path: str, body: bytes,
                       headers: dict[str, str]) -> bool | ApiError:
        """One try on *node*: True once answered, False to try another node, or the 503 it gave."""
        request = self.client.build_request("POST", f"{node.url}{path}", content=body, headers=headers)
        try:
            response = await self.client.send(request, stream=True)
        except httpx.TransportError as exc:
            node.mark_failed(_describe(exc))
            return False
        try:
            if response.status_code == 503:
                return await _busy_error(response)
            chunks = response.aiter_raw()
            try:
                first = await anext(chunks, b"")
            except httpx.TransportError as exc:
                node.mark_failed(_describe(exc))
                return False
            passed = {k: v for k, v in response.headers.items() if k.lower() in FORWARDED_RESPONSE_HEADERS}
            await send.send(Head(response.status_code, passed, node.id))
            try:
                if first:
                    await send.send(first)
                async for chunk in chunks:
                    await send.send(chunk)
            except httpx.TransportError as exc:
                node.mark_failed(f"mid-answer: {_describe(exc)}")
                await send.send(MID_STREAM_FAILURE)
                return True
            node.served += 1
            return True
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                await response.aclose()


async def _busy_error(response: httpx.Response) -> ApiError:
    """The node's own 503, to answer with if no other node takes the request."""
    try:
        error = json.loads(await response.aread())["error"]
        return ApiError(503, str(error["message"]), type="server_error", code=str(error.get("code") or "unavailable"))
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return unavailable("the serving node is unavailable; retry later", "unavailable")


async def relay(receive: trio.MemoryReceiveChannel[object], scope: trio.CancelScope,
                event_stream: bool) -> AsyncIterator[bytes]:
    """The response body: the node's chunks as they arrive. Cancels the backend request when it ends early."""
    try:
        async with receive:
            async for item in receive:
                if isinstance(item, MidStreamFailure):
                    if event_stream:
                        error = unavailable("the serving node failed mid-answer", "backend_failed")
                        yield b"data: " + json.dumps(error.body()).encode() + b"\n\n"
                    return
                assert isinstance(item, bytes)
                yield item
    finally:
        scope.cancel()
