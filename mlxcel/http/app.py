"""The quart-trio app both roles start from: the request scope, the API-key gate and OpenAI-shaped errors.

A serving node (:func:`mlxcel.server.create_app`) and a router
(:func:`mlxcel.router.app.create_router_app`) add their routes to it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from .auth import credential, is_public, key_matches
from .errors import HTTP_ERROR_TYPES, ApiError, error_response
from .scope import RequestScope

logger = logging.getLogger(__name__)


def key_required() -> ApiError:
    """The 401 a request without an accepted key gets (missing and wrong keys get the same answer)."""
    return ApiError(401, "a valid API key is required (Authorization: Bearer KEY or X-Api-Key: KEY)",
                    type="authentication_error", code="invalid_api_key")


def create_app(name: str, *, api_keys: tuple[str, ...], max_body_bytes: int,
               no_route: Callable[[str, str], str]) -> QuartTrio:
    """An app named *name* that refuses requests without one of *api_keys* (none: open) on every path but the
    public ones, bodies over *max_body_bytes*, and answers every error OpenAI's way (*no_route(method, path)*:
    a 404's message)."""
    app = QuartTrio(name)
    # Bodies keep the documented field order (the policy contract lists its fields in order).
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    # Generations can outlast Quart's 60 s default; clients that go away are noticed anyway.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 60
    # Every request gets a scope whose cleanups run however its call ends (see scope.at_request_end).
    app.asgi_app = RequestScope(app.asgi_app)  # type: ignore[method-assign]

    @app.before_request
    async def require_key() -> Response | None:
        if not api_keys or is_public(request.path):
            return None
        presented = credential(request.headers.get("Authorization"), request.headers.get("X-Api-Key"))
        if key_matches(presented, api_keys):
            return None
        return error_response(key_required())

    @app.errorhandler(ApiError)
    async def api_error(error: ApiError) -> Response:
        return error_response(error)

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        status = error.code or 500
        kind, code = HTTP_ERROR_TYPES.get(status, ("invalid_request_error", None))
        message = error.description or error.name
        if status == 413:
            message = f"the request body is larger than {max_body_bytes} bytes"
        elif status == 404:
            message = no_route(request.method, request.path)
        return error_response(ApiError(status, message, type=kind, code=code))

    @app.errorhandler(Exception)
    async def internal_error(error: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(ApiError(500, "internal server error", type="server_error", code="internal"))

    return app
