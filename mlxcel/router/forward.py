"""Forwarding one generation request to a serving node, with retry before the first byte.

Each request's backend side runs as one task in the router's nursery, under its
own cancel scope, and talks to the route handler over an unbuffered memory
channel: first a :class:`Head` (or the :class:`~mlxcel.http.errors.ApiError`
to answer with), then the body's chunks as the node sends them, so a stream
passes through chunk by chunk and nothing is buffered. The handler registers
the scope's ``cancel`` with :func:`~mlxcel.http.scope.at_request_end`:
however the client's request ends (finished, disconnected before or during the
stream, even before Quart starts the body) the backend request is closed, and
the serving node cancels its generation.

A node whose connection cannot be made (refused, timed out) is marked
unhealthy and the request is tried on another node; so is a node that answers
503 (loading, at capacity, shutting down), without being marked, and one that
refuses the router's own key. Once the request was sent, it is never sent
again: a node that fails with it in flight (reset, killed, silent past the
read timeout) may have failed *because* of it, so the client gets a 502
(``backend_failed``) and the node is marked unhealthy and counted in ``lost``.
A non-streamed answer is read whole before any of it is passed on, so one cut
short is that 502, not a truncated 200. A stream is committed at its first
byte: a failure after it ends the client's stream with an error event and no
``[DONE]``, as a serving node that goes away mid-stream does.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import cast

import httpx
import trio

from ..http.errors import ApiError, unavailable
from .nodes import Node, _describe, model_ids
from .placement import Placement

logger = logging.getLogger(__name__)

#: Request headers passed on to a node. The client's own credentials are never passed on.
FORWARDED_REQUEST_HEADERS = ("content-type", "accept")
#: Response headers passed back to the client (hop-by-hop and framing headers are the router's own).
FORWARDED_RESPONSE_HEADERS = ("content-type", "cache-control", "location", "retry-after")


@dataclass(frozen=True, slots=True)
class Head:
    """A node's answer has begun: its status and the headers passed back."""

    status: int
    headers: dict[str, str]
    node: str


class MidStreamFailure:
    """The node failed after the answer was committed to it."""


MID_STREAM_FAILURE = MidStreamFailure()


class Answered:
    """The client has its answer from this try, or its error: nothing is tried again."""


ANSWERED = Answered()


class NotDelivered:
    """The connection to the node was never made: the request may go to another node."""


NOT_DELIVERED = NotDelivered()


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
                   model: str | None = None) -> tuple[trio.CancelScope, trio.MemoryReceiveChannel[object]]:
        """Start forwarding to a node that serves *model* (the request's; None: any); the scope that ends it and
        the channel its head and chunks arrive on."""
        send, receive = trio.open_memory_channel[object](0)
        scope = trio.CancelScope()
        outgoing = {k: v for k, v in headers.items() if k.lower() in FORWARDED_REQUEST_HEADERS}
        nursery.start_soon(self._run, scope, send, path, body, {**outgoing, **self.backend_headers}, model)
        return scope, receive

    async def _run(self, scope: trio.CancelScope, send: trio.MemorySendChannel[object], path: str, body: bytes,
                   headers: dict[str, str], model: str | None) -> None:
        with scope:
            async with send:
                try:
                    await self._forward(send, path, body, headers, model)
                except trio.BrokenResourceError:
                    pass  # the handler is gone; the scope is being cancelled too
                except Exception:  # never take the router down: this request ends, the others go on
                    logger.exception("forwarding %s failed", path)

    async def _forward(self, send: trio.MemorySendChannel[object], path: str, body: bytes,
                       headers: dict[str, str], model: str | None) -> None:
        # The nodes that do not serve the model count as tried: placement chooses among the others.
        tried = {i for i, node in enumerate(self.nodes) if not node.serves(model)}
        if len(tried) == len(self.nodes):
            served = ", ".join(repr(n) for n in model_ids(self.nodes))
            await send.send(ApiError(404, f"the model {model!r} does not exist; the nodes serve {served}",
                                     param="model", code="model_not_found"))
            return
        others = len(tried)
        refused: ApiError | None = None
        while True:
            choice = self.placement.choose(self.nodes, frozenset(tried))
            if choice is None:
                self.rejected += 1
                await send.send(refused or unavailable("no serving node can take this request now; retry later",
                                                       "no_backend"))
                return
            index, reason = choice
            if len(tried) > others:
                self.rerouted += 1
            tried.add(index)
            self.decisions[reason] += 1
            node = self.nodes[index]
            node.in_flight += 1  # no checkpoint since choose(): the next request's choice sees it
            try:
                outcome = await self._attempt(send, node, path, body, headers)
            finally:
                node.in_flight -= 1
            if outcome is ANSWERED:
                return
            if isinstance(outcome, ApiError):
                refused = outcome

    async def _attempt(self, send: trio.MemorySendChannel[object], node: Node, path: str, body: bytes,
                       headers: dict[str, str]) -> Answered | NotDelivered | ApiError:
        """One try on *node*: ANSWERED once the client has its answer (or its error), NOT_DELIVERED when the
        connection was never made, or the node's refusal (its 503, a 401 to the router's key) to answer with
        if no other node takes the request."""
        request = self.client.build_request("POST", f"{node.url}{path}", content=body, headers=headers)
        try:
            response = await self.client.send(request, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            node.mark_failed(_describe(exc))
            return NOT_DELIVERED
        except httpx.TransportError as exc:
            await self._lost(send, node, exc)
            return ANSWERED
        try:
            if response.status_code == 503:
                return await _busy_error(response)
            if response.status_code in (401, 403):
                logger.warning("%s refused the router's key (%d): check --backend-api-key", node.id,
                               response.status_code)
                return ApiError(502, "the serving node refused the router's own credentials; the router is "
                                     "misconfigured (its --backend-api-key)", type="server_error",
                                code="backend_auth")
            passed = {k: v for k, v in response.headers.items() if k.lower() in FORWARDED_RESPONSE_HEADERS}
            head = Head(response.status_code, passed, node.id)
            if not response.headers.get("content-type", "").startswith("text/event-stream"):
                return await self._whole(send, node, response, head)
            # Closed here, not by the garbage collector whenever it finds it: a relay cut short (the client gone,
            # the request cancelled) leaves the generator suspended, and its finalizer would run outside trio.
            # (httpx annotates it as an AsyncIterator; it is an async generator.)
            async with aclosing(cast(AsyncGenerator[bytes, None], response.aiter_raw())) as chunks:
                try:
                    first = await anext(chunks, b"")
                except httpx.TransportError as exc:
                    await self._lost(send, node, exc)
                    return ANSWERED
                await send.send(head)
                try:
                    if first:
                        await send.send(first)
                    async for chunk in chunks:
                        await send.send(chunk)
                except httpx.TransportError as exc:
                    node.lose_request(f"mid-stream: {_describe(exc)}", timed_out=isinstance(exc, httpx.ReadTimeout))
                    await send.send(MID_STREAM_FAILURE)
                    return ANSWERED
            node.mark_served()
            return ANSWERED
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(2):
                await response.aclose()

    async def _whole(self, send: trio.MemorySendChannel[object], node: Node, response: httpx.Response,
                     head: Head) -> Answered:
        """A non-streamed answer, read whole before any of it is passed on: one cut short is an error, never
        a 200 with truncated JSON."""
        try:
            body = await response.aread()
        except httpx.TransportError as exc:
            await self._lost(send, node, exc)
            return ANSWERED
        await send.send(head)
        await send.send(body)
        node.mark_served()
        return ANSWERED

    async def _lost(self, send: trio.MemorySendChannel[object], node: Node, exc: httpx.TransportError) -> None:
        """*node* failed with the request in flight: a 502, never a replay on another node.

        The request may be what took the node down (a crash any client could send would then take
        every node in turn), and it may have run there in part; the router cannot tell, so, as a
        proxy does with a request that is not idempotent, it does not send it again.
        """
        node.lose_request(f"with a request in flight: {_describe(exc)}", timed_out=isinstance(exc, httpx.ReadTimeout))
        await send.send(ApiError(502, "the serving node failed while handling this request; it was not retried "
                                      "on another node, since the request itself may have caused the failure",
                                 type="server_error", code="backend_failed"))


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
