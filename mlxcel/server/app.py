"""The quart-trio application: routes, the API-key gate, OpenAI-shaped errors, request metrics."""

from __future__ import annotations

import logging

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from ..observability import Observability
from . import openai_routes, status_routes
from .auth import PUBLIC_PATHS, credential, key_matches
from .context import EngineApi, RequestScope, ServerContext, ServerOptions
from .errors import HTTP_ERROR_TYPES, ApiError, error_response

logger = logging.getLogger(__name__)


def create_app(engine: EngineApi, observability: Observability, options: ServerOptions) -> QuartTrio:
    """The app for a model-serving node."""
    app = QuartTrio("mlxcel")
    # Bodies keep the documented field order (the policy contract lists its fields in order).
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.config["MAX_CONTENT_LENGTH"] = options.max_body_bytes
    # Generations can outlast Quart's 60 s default; clients that go away are noticed anyway.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = 60
    ctx = ServerContext(engine=engine, observability=observability, options=options)
    # Every request gets a scope whose cleanups run however its call ends (see context.at_request_end).
    app.asgi_app = RequestScope(app.asgi_app)  # type: ignore[method-assign]

    @app.before_request
    async def require_key() -> Response | None:
        if not options.api_keys or request.path in PUBLIC_PATHS:
            return None
        presented = credential(request.headers.get("Authorization"), request.headers.get("X-Api-Key"))
        if key_matches(presented, options.api_keys):
            return None
        # Missing and wrong keys get the same answer.
        return error_response(ApiError(401, "a valid API key is required (Authorization: Bearer KEY "
                                            "or X-Api-Key: KEY)", type="authentication_error",
                                       code="invalid_api_key"))

    @app.after_request
    async def count(response: Response) -> Response:
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        observability.requests.labels(route=rule, status=str(response.status_code)).inc()
        return response

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
            message = f"no route {request.method} {request.path}"
        return error_response(ApiError(status, message, type=kind, code=code))

    @app.errorhandler(Exception)
    async def internal_error(error: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(ApiError(500, "internal server error", type="server_error", code="internal"))

    status_routes.register(app, ctx)
    openai_routes.register(app, ctx)
    return app


