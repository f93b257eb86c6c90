"""A serving node's quart-trio application: the shared app, request metrics, the status and OpenAI routes."""

from __future__ import annotations

from quart import Response, request
from quart_trio import QuartTrio

from ..http.app import create_app as create_base_app
from ..observability import Observability
from . import anthropic_routes, openai_routes, responses_routes, status_routes
from .context import EngineApi, ServerContext, ServerOptions
from .memory import MemoryLedger


def create_app(engine: EngineApi, observability: Observability, options: ServerOptions,
               ledger: MemoryLedger | None = None) -> QuartTrio:
    """The app for a model-serving node: the shared app (:mod:`mlxcel.http.app`), request metrics and the routes."""
    app = create_base_app("mlxcel", api_keys=options.api_keys, max_body_bytes=options.max_body_bytes,
                          no_route=lambda method, path: f"no route {method} {path}")
    ctx = ServerContext(engine=engine, observability=observability, options=options, ledger=ledger)

    @app.after_request
    async def count(response: Response) -> Response:
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        observability.requests.labels(route=rule, status=str(response.status_code)).inc()
        return response

    status_routes.register(app, ctx)
    openai_routes.register(app, ctx)
    anthropic_routes.register(app, ctx)
    responses_routes.register(app, ctx)
    return app
