"""Routes that report state: the page, health, the MTP policy, server status, cache statistics, props, slots,
metrics.

All of them read the last values the engine published; none waits on the decode loop.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from quart import Quart, Response, jsonify

from .. import __version__, page
from ..observability import Observability
from .context import ServerOptions
from .memory import MemoryLedger


def register(app: Quart, observability: Observability, options: ServerOptions, ledger: MemoryLedger | None) -> None:

    page.register(app, lambda: {
        "name": "mlxcel", "version": __version__, "model": options.model_name,
        "endpoints": ["/health", "/v1/models", "/v1/completions", "/v1/chat/completions",
                      "/v1/internal/mtp-policy", "/v1/internal/server-status", "/v1/cache/stats"]})

    async def health() -> Any:
        state = observability.state
        body: dict[str, Any] = {"status": "ok" if state == "ready" else state,
                                "model": options.model_name}
        if observability.error:
            body["error"] = observability.error
        if state == "loading" and observability.loading is not None:
            body["loading"] = observability.loading  # what the start is doing: its last progress line
        body["observability"] = {"mtp_policy": observability.policy.to_health(), "blas": observability.blas}
        if ledger is not None:
            body["memory"] = ledger.to_json()
        return body, 200 if state == "ready" else 503

    app.add_url_rule("/health", "health", health, methods=["GET"])
    app.add_url_rule("/v1/health", "v1_health", health, methods=["GET"])

    @app.get("/v1/internal/mtp-policy")
    async def mtp_policy() -> Response:
        # Serialised when the engine published it: polling costs no JSON work.
        return Response(observability.policy_wire, content_type="application/json")

    @app.get("/v1/internal/server-status")
    async def server_status() -> Any:
        return observability.status_json()

    @app.get("/v1/cache/stats")
    async def cache_stats() -> Any:
        return observability.cache.to_json()

    if options.props:
        @app.get("/props")
        async def props() -> Any:
            return {"model": options.model_name, "model_path": str(options.model_path),
                    "n_ctx": options.context_length, "total_slots": options.parallel,
                    "default_generation_settings": {"max_tokens": options.default_max_tokens,
                                                    "temperature": 1.0, "top_p": 1.0, "top_k": 0},
                    **options.extra_props}

    if options.slots:
        @app.get("/slots")
        async def slots() -> Any:
            return jsonify([{"id": s.id, "is_processing": s.is_processing, "n_ctx": options.context_length,
                             "n_prompt_tokens": s.n_prompt_tokens, "n_decoded": s.n_decoded}
                            for s in observability.slots])

    if options.metrics:
        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(observability.registry), content_type=CONTENT_TYPE_LATEST)
