"""OpenAI's ``POST /v1/embeddings``, and what a chat model and an embedding model answer on each other's routes.

The request (OpenAI's ``CreateEmbeddingRequest``): ``input`` is a string, a list of strings, a list of token ids
or a list of such lists; ``encoding_format`` ``float`` (the default) or ``base64`` (little-endian float32, what
the ``openai`` package asks for and decodes); ``dimensions`` where the model was trained to be truncated
(Matryoshka), the vector then cut and scaled to unit length again. OpenAI's bounds: 2,048 inputs, 300,000 tokens
a request; each input at most the model's longest (a 400 names it: nothing is silently truncated).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import trio
from quart import Quart

from ..embeddings.layout import EmbeddingLayout
from ..engine import EngineUnavailable, QueueFull
from ..http.errors import ApiError, bad_request, unavailable
from .context import ServerOptions, no_such_model, serves
from .wire import json_body

#: OpenAI's own bounds on one request.
MAX_INPUTS = 2048
MAX_REQUEST_TOKENS = 300_000
#: The generation routes, which an embedding model refuses with a 400 (in the route's own error shape).
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                     "/v1/messages/count_tokens")


class EmbedderApi(Protocol):
    """An embedding model as the routes see it (:class:`mlxcel.embeddings.engine.EmbeddingEngine`)."""

    ready: trio.Event

    async def tokenize(self, texts: list[str]) -> list[list[int]]: ...

    async def embed(self, rows: list[list[int]]) -> np.ndarray: ...

    def cancelled_on_stop(self) -> Any: ...


@dataclass(frozen=True)
class EmbeddingRequest:
    texts: list[str] | None
    """The inputs as text, or None when they came as token ids (:attr:`rows`)."""
    rows: list[list[int]] | None
    encoding_format: str
    dimensions: int | None


def parse_request(body: dict[str, Any], layout: EmbeddingLayout, vocab_size: int) -> EmbeddingRequest:
    """The request *body* as mlxcel serves it, or the 400 that says what is wrong with it."""
    given = body.get("input")
    texts: list[str] | None = None
    rows: list[list[int]] | None = None
    if isinstance(given, str):
        texts = [given]
    elif isinstance(given, list) and given and all(isinstance(item, str) for item in given):
        texts = given
    elif isinstance(given, list) and given and all(_is_token(item) for item in given):
        rows = [given]
    elif isinstance(given, list) and given and all(isinstance(item, list) for item in given):
        rows = given
        if not all(row and all(_is_token(t) for t in row) for row in rows):
            raise bad_request("input: every list of token ids must be non-empty integers", param="input")
    else:
        raise bad_request("input must be a non-empty string, list of strings, list of token ids, or list of "
                          "lists of token ids", param="input")
    inputs = texts if texts is not None else rows
    assert inputs is not None
    if len(inputs) > MAX_INPUTS:
        raise bad_request(f"input holds {len(inputs)} items; at most {MAX_INPUTS} a request", param="input")
    if texts is not None and any(text == "" for text in texts):
        raise bad_request(f"input[{texts.index('')}] is an empty string", param="input")
    if rows is not None:
        for index, row in enumerate(rows):
            if any(not 0 <= token < vocab_size for token in row):
                raise bad_request(f"input[{index}] holds a token id outside this model's vocabulary "
                                  f"(0..{vocab_size - 1})", param="input")
    encoding = body.get("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise bad_request("encoding_format must be 'float' or 'base64'", param="encoding_format")
    return EmbeddingRequest(texts, rows, encoding, _dimensions(body.get("dimensions"), layout))


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _dimensions(value: object, layout: EmbeddingLayout) -> int | None:
    if value is None:
        return None
    if not _is_token(value) or not 1 <= int(value) <= layout.dimensions:  # type: ignore[call-overload]
        raise bad_request(f"dimensions must be an integer from 1 to {layout.dimensions}", param="dimensions")
    chosen = int(value)  # type: ignore[call-overload]
    if chosen == layout.dimensions:
        return None
    if layout.truncatable is None:
        raise bad_request(f"this model's embeddings have {layout.dimensions} dimensions and it was not trained to "
                          "be truncated (its config.json declares no matryoshka_dimensions)", param="dimensions",
                          code="unsupported_parameter")
    if layout.truncatable and chosen not in layout.truncatable:
        listed = ", ".join(str(d) for d in layout.truncatable)
        raise bad_request(f"dimensions must be one of {listed} or {layout.dimensions}", param="dimensions")
    return chosen


def check_lengths(rows: list[list[int]], layout: EmbeddingLayout) -> int:
    """The request's tokens, or the 400 for an input longer than the model takes or a request over the bound."""
    for index, row in enumerate(rows):
        if len(row) > layout.max_tokens:
            raise ApiError(400, f"input[{index}] is {len(row)} tokens; this model embeds at most "
                                f"{layout.max_tokens}", param="input", code="context_length_exceeded")
    total = sum(len(row) for row in rows)
    if total > MAX_REQUEST_TOKENS:
        raise bad_request(f"the inputs add up to {total} tokens; at most {MAX_REQUEST_TOKENS} a request",
                          param="input")
    return total


def response_body(vectors: np.ndarray, request: EmbeddingRequest, model: str, tokens: int) -> dict[str, Any]:
    """OpenAI's ``CreateEmbeddingResponse`` for *vectors* (rows in input order)."""
    if request.dimensions is not None:
        vectors = vectors[:, :request.dimensions]
        vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    vectors = np.ascontiguousarray(vectors, dtype="<f4")
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(row.tobytes()).decode("ascii") if request.encoding_format == "base64"
             else row.tolist()} for i, row in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def register(app: Quart, embedder: EmbedderApi, options: ServerOptions, layout: EmbeddingLayout,
             vocab_size: int) -> None:
    """The embedding model's routes: ``POST /v1/embeddings``, and a 400 on every generation route."""

    @app.post("/v1/embeddings")
    async def embeddings() -> Any:
        body = await json_body(embedder)  # type: ignore[arg-type]
        model = body.get("model")
        if model is not None and (not isinstance(model, str) or not serves(options, model)):
            raise ApiError(404, no_such_model(options, str(model)), param="model", code="model_not_found")
        request = parse_request(body, layout, vocab_size)
        try:
            rows = request.rows if request.rows is not None else await embedder.tokenize(request.texts or [])
            tokens = check_lengths(rows, layout)
            vectors = await embedder.embed(rows)
        except QueueFull as exc:
            raise unavailable(f"the server is at capacity ({exc}); retry later", "queue_full") from exc
        except EngineUnavailable as exc:
            raise unavailable(str(exc), "unavailable") from exc
        return response_body(vectors, request, options.model_name or "", tokens)

    async def generation() -> Any:
        raise bad_request(f"the model {options.model_name!r} is an embedding model: it serves /v1/embeddings only",
                          param="model", code="model_not_supported")

    for path in GENERATION_ROUTES:
        app.add_url_rule(path, f"refused {path}", generation, methods=["POST"])


def refuse_embeddings(app: Quart, options: ServerOptions) -> None:
    """A generation model's ``POST /v1/embeddings``: a 400 that says so (not a 404: the route exists here)."""

    @app.post("/v1/embeddings")
    async def embeddings() -> Any:
        raise bad_request(f"the model {options.model_name!r} is a generation model, not an embedding model; "
                          "serve an embedding checkpoint (sentence-transformers layout) for /v1/embeddings",
                          param="model", code="model_not_supported")
