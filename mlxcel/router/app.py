"""The router's quart-trio app: exactly ``/`` (the page, :mod:`mlxcel.page`, showing its nodes), ``/health``,
``/router/stats``, ``/v1/models`` (the union of its nodes')
and the two generation routes, each sent to a node that serves the model the request names.

Every other path is 404 with an OpenAI-shaped body (``/metrics`` and the policy endpoint included: the
contract's router exception). The API-key
gate and the error handlers are the serving node's (``mlxcel/http/app.py``), with the router's own keys.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import trio
from quart import Response, request
from quart_trio import QuartTrio

from .. import __version__, page
from ..fleet.asgi import model_named
from ..http.app import create_app
from ..http.errors import ApiError
from ..http.scope import at_request_end
from .forward import Forwarder, Head, relay
from .nodes import Node, models_body, stats_body

logger = logging.getLogger(__name__)

#: The only paths a router mounts.
ROUTER_PATHS = ("/", "/health", "/router/stats", "/v1/models", "/v1/chat/completions", "/v1/completions",
                "/v1/embeddings")


@dataclass(frozen=True)
class RouterOptions:
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 1024 * 1024
    show_addresses: bool = False
    """/router/stats names each node's address (``--router-stats-verbose``)."""


@dataclass
class RouterState:
    """What the routes read: the nodes, the forwarder, whether the first probe round is done."""

    nodes: list[Node]
    forwarder: Forwarder
    nursery: trio.Nursery
    """Where each request's backend task runs (see forward.py)."""
    probed: trio.Event


def create_router_app(state: RouterState, options: RouterOptions) -> QuartTrio:
    app = create_app("mlxcel-router", api_keys=options.api_keys, max_body_bytes=options.max_body_bytes,
                     no_route=lambda method, path: f"no route {method} {path} on a router (it serves "
                                                   f"{', '.join(ROUTER_PATHS)})")

    page.register(app, lambda: {"name": "mlxcel-router", "version": __version__, "endpoints": list(ROUTER_PATHS)})

    @app.get("/health")
    async def health() -> Any:
        healthy = sum(node.healthy for node in state.nodes)
        status = "ok" if healthy else ("starting" if not state.probed.is_set() else "no_healthy_backend")
        return {"status": status, "role": "router", "nodes": len(state.nodes), "healthy_nodes": healthy}, \
            200 if healthy else 503

    @app.get("/router/stats")
    async def stats() -> Any:
        forwarder = state.forwarder
        return stats_body(state.nodes, forwarder.decisions, rerouted=forwarder.rerouted, rejected=forwarder.rejected,
                          placement=forwarder.placement.mode, show_addresses=options.show_addresses)

    @app.get("/v1/models")
    async def models() -> Any:
        return models_body(state.nodes)

    async def forward(path: str) -> Response:
        body = await request.get_data(cache=False)
        assert isinstance(body, bytes)
        scope, receive = await state.forwarder.open(state.nursery, path, body, dict(request.headers),
                                                    (await model_named(body))[0])
        # No checkpoint since open(): however this request ends, its backend request ends with it.
        at_request_end(scope.cancel)
        try:
            head = await receive.receive()
        except trio.EndOfChannel:  # the backend task failed unexpectedly (it logged why)
            raise ApiError(502, "the router could not forward this request", type="server_error",
                           code="bad_gateway") from None
        if isinstance(head, ApiError):
            raise head
        assert isinstance(head, Head)
        headers = dict(head.headers)
        content_type = headers.pop("content-type", "application/json")
        response = Response(relay(receive, scope, content_type.startswith("text/event-stream")),
                            status=head.status, headers=headers, content_type=content_type)
        response.headers["X-Mlxcel-Node"] = head.node
        response.timeout = None
        return response

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await forward("/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await forward("/v1/chat/completions")

    @app.post("/v1/embeddings")
    async def embeddings() -> Response:
        return await forward("/v1/embeddings")

    return app

