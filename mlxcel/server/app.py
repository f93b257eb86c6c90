"""A serving node's quart-trio application: the shared app, request metrics, the status and API routes; a
generation model's (:func:`create_app`) or an embedding model's (:func:`create_embedding_app`)."""

from __future__ import annotations

import time

from quart import Response, request
from quart_trio import QuartTrio

from ..embeddings.layout import EmbeddingLayout
from ..http.app import create_app as create_base_app
from ..observability import Observability
from . import anthropic_routes, embedding_routes, model_routes, openai_routes, responses_routes, status_routes
from .context import EngineApi, ServerContext, ServerOptions
from .embedding_routes import EmbedderApi
from .memory import MemoryLedger


def create_app(engine: EngineApi, observability: Observability, options: ServerOptions,
               ledger: MemoryLedger | None = None) -> QuartTrio:
    """The app for a model-serving node: the shared app (:mod:`mlxcel.http.app`), request metrics and the routes."""
    app = create_base_app("mlxcel", api_keys=options.api_keys, max_body_bytes=options.max_body_bytes,
                          no_route=lambda method, path: f"no route {method} {path}")
    ctx = ServerContext(engine=engine, observability=observability, options=options, ledger=ledger)
    _count_requests(app, observability)
    status_routes.register(app, observability, options, ledger)
    openai_routes.register(app, ctx)
    anthropic_routes.register(app, ctx)
    responses_routes.register(app, ctx)
    embedding_routes.refuse_embeddings(app, options)
    return app


def create_embedding_app(embedder: EmbedderApi, observability: Observability, options: ServerOptions,
                         layout: EmbeddingLayout, vocab_size: int, ledger: MemoryLedger | None = None) -> QuartTrio:
    """The app for an embedding model: the shared app, request metrics, the status routes (its policy endpoint
    says ``unavailable/no_mtp_dispatch``), the model list and ``/v1/embeddings``; generation routes answer 400."""
    app = create_base_app("mlxcel", api_keys=options.api_keys, max_body_bytes=options.max_body_bytes,
                          no_route=lambda method, path: f"no route {method} {path}")
    _count_requests(app, observability)
    status_routes.register(app, observability, options, ledger)
    model_routes.register(app, options, kind="embedding")
    embedding_routes.register(app, embedder, options, layout, vocab_size)
    return app


HEALTH_ROUTES = frozenset({"/health", "/v1/health"})


def _count_requests(app: QuartTrio, observability: Observability) -> None:
    @app.after_request
    async def count(response: Response) -> Response:
        rule = request.url_rule.rule if request.url_rule is not None else "unmatched"
        observability.requests.labels(route=rule, status=str(response.status_code)).inc()
        if response.status_code >= 400 and rule not in HEALTH_ROUTES:  # a 503 there says "loading", not an error
            observability.errors.append((time.time(), rule, response.status_code))
        return response
