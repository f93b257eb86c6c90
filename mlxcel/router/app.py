"""The router's quart-trio app: exactly ``/health``, ``/router/stats`` and the two generation routes.

Every other path is 404 with an OpenAI-shaped body (``/v1/models``, ``/metrics``
and the policy endpoint included: the contract's router exception). The API-key
gate is the serving node's (``server/auth.py``), with the router's own keys.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from ..server.auth import PUBLIC_PATHS, credential, key_matches
from ..server.context import RequestScope, at_request_end
from ..server.errors import HTTP_ERROR_TYPES, ApiError, error_response
from .forward import Forwarder, Head, relay
from .nodes import Node, stats_body

logger = logging.getLogger(__name__)

#: The only paths a router mounts.
ROUTER_PATHS = ("/health", "/router/stats", "/v1/chat/completions", "/v1/completions")


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
    app = QuartTrio("mlxcel-router")
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.config["MAX_CONTENT_LENGTH"] = options.max_body_bytes
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 60
    app.asgi_app = RequestScope(app.asgi_app)  # type: ignore[method-assign]

    @app.before_request
    async def require_key() -> Response | None:
        if not options.api_keys or request.path in PUBLIC_PATHS:
            return None
        presented = credential(request.headers.get("Authorization"), request.headers.get("X-Api-Key"))
        if key_matches(presented, options.api_keys):
            return None
        return error_response(ApiError(401, "a valid API key is required (Authorization: Bearer KEY "
                                            "or X-Api-Key: KEY)", type="authentication_error",
                                       code="invalid_api_key"))

    @app.errorhandler(ApiError)
    async def api_error(error: ApiError) -> Response:
        return error_response(error)

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        status = error.code or 500
        kind, code = HTTP_ERROR_TYPES.get(status, ("invalid_request_error", None))
        message = error.description or error.name
        if status == 413:
            message = f"the request body is larger than {options.max_body_bytes} bytes"
        elif status == 404:
            message = f"no route {request.method} {request.path} on a router (it serves {', '.join(ROUTER_PATHS)})"
        return error_response(ApiError(status, message, type=kind, code=code))

    @app.errorhandler(Exception)
    async def internal_error(error: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(ApiError(500, "internal server error", type="server_error", code="internal"))

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

    async def forward(path: str) -> Response:
        body = await request.get_data(cache=False)
        assert isinstance(body, bytes)
        scope, receive = await state.forwarder.open(state.nursery, path, body, dict(request.headers))
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

    return app
