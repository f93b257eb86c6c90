"""``GET /v1/models`` and ``GET /v1/models/{model}`` of a node serving one model."""

from __future__ import annotations

from typing import Any

from quart import Quart

from ..http.errors import ApiError
from .context import ServerOptions, no_such_model, serves


def model_object(options: ServerOptions, kind: str) -> dict[str, Any]:
    """OpenAI's ``Model`` with what clients and a router read besides: ``max_model_len`` (the context length,
    under vLLM's name: clients size their prompts by it), ``names`` (every name and pattern a request's
    ``model`` may use here: what a router routes by), ``kind`` (``generation`` or ``embedding``)."""
    return {"id": options.model_name, "object": "model", "created": 0, "owned_by": "mlxcel",
            "max_model_len": options.context_length, "kind": kind,
            "names": [options.model_name, *options.aliases, *options.patterns]}


def register(app: Quart, options: ServerOptions, *, kind: str) -> None:
    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [model_object(options, kind)]}

    @app.get("/v1/models/<path:model>")
    async def model(model: str) -> Any:
        # <path:...>: Hugging Face style ids ("org/name") hold a slash.
        if not serves(options, model) or model == "default":
            raise ApiError(404, no_such_model(options, model), param="model", code="model_not_found")
        return model_object(options, kind)
