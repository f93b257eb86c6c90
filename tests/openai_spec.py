"""OpenAI's published OpenAPI document as a validator of what the server sends.

The document is the subset in ``tests/data/`` (a verbatim copy of OpenAI's published schemas,
committed so that CI's clean clone has it; provenance in ``tests/data/openai-openapi-README.md``),
read with ``jsonschema``'s Draft 2020-12 validator (the dialect of OpenAPI
3.1). Two readings the README names: OpenAPI 3.0's ``nullable: true`` is "or
null", and streamed completion chunks share ``CreateCompletionResponse`` with a
``finish_reason`` that is null on every chunk but the last. A third, which the
document does not spell: with ``echo`` and ``logprobs`` the prompt's first token
has nothing before it, so its ``token_logprobs`` and ``top_logprobs`` entries
are null, as OpenAI's API sends them (and vLLM). The reading lets any entry of
those two arrays be null; the tests check that it is only the first.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema

SPEC_PATH = Path(__file__).resolve().parent / "data" / "openai-openapi-subset.json"


def _or_null(node: Any) -> Any:
    """*node* with every ``nullable: true`` turned into ``anyOf: [..., null]``."""
    if isinstance(node, list):
        return [_or_null(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = {key: _or_null(value) for key, value in node.items()}
    if node.pop("nullable", False) is True:
        return {"anyOf": [node, {"type": "null"}]}
    return node


def _load() -> dict[str, Any]:
    document: dict[str, Any] = _or_null(json.loads(SPEC_PATH.read_text()))
    schemas = document["components"]["schemas"]
    logprobs = schemas["CreateCompletionResponse"]["properties"]["choices"]["items"]["properties"]["logprobs"]
    arrays = next(option for option in logprobs["anyOf"] if option.get("type") == "object")["properties"]
    for name in ("token_logprobs", "top_logprobs"):  # the third reading: the echoed prompt's first token
        arrays[name]["items"] = {"anyOf": [arrays[name]["items"], {"type": "null"}]}
    chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
    reason = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
    chunk["properties"]["choices"]["items"]["properties"]["finish_reason"] = {"anyOf": [reason, {"type": "null"}]}
    schemas["CreateCompletionStreamChunk"] = chunk  # our name, for the shared shape's streamed reading
    return document


_DOCUMENT = _load()
_VALIDATORS: dict[str, jsonschema.Draft202012Validator] = {}


def validator(name: str) -> jsonschema.Draft202012Validator:
    """A validator for the component schema *name*, its references resolved within the document."""
    if name not in _VALIDATORS:
        root = {**_DOCUMENT, "$ref": f"#/components/schemas/{name}"}
        _VALIDATORS[name] = jsonschema.Draft202012Validator(root)
    return _VALIDATORS[name]


def problems(name: str, body: Any) -> list[str]:
    """Every way *body* breaks schema *name*, one line each (empty: it conforms)."""
    return [f"{name}: {'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}"
            for e in validator(name).iter_errors(body)]


def response_schema(method: str, path: str, status: int, streamed: bool) -> str | None:
    """The schema an OpenAI route's response body (or each streamed event) follows; None: not an OpenAI body."""
    if not path.startswith("/v1/") or path == "/v1/health":  # /v1/health's 503 says {"status": "loading"}
        return None
    if path == "/v1/messages" or path.startswith("/v1/messages/"):  # Anthropic's API: its SDK parses those
        return None
    if status >= 400:
        return "ErrorResponse"
    if method == "GET" and path == "/v1/models":
        return "ListModelsResponse"
    if method == "GET" and path.startswith("/v1/models/"):
        return "Model"
    if method == "POST" and path == "/v1/completions":
        return "CreateCompletionStreamChunk" if streamed else "CreateCompletionResponse"
    if method == "POST" and path == "/v1/chat/completions":
        return "CreateChatCompletionStreamResponse" if streamed else "CreateChatCompletionResponse"
    return None


def sse_payloads(body: bytes) -> list[Any]:
    """The JSON payloads of a server-sent event stream's complete events (``[DONE]`` and a cut tail left out)."""
    payloads = []
    for event in body.decode("utf-8", "replace").split("\n\n")[:-1]:
        data = "".join(line[6:] for line in event.split("\n") if line.startswith("data: "))
        if data and data != "[DONE]":
            payloads.append(json.loads(data))
    return payloads


def body_problems(method: str, path: str, status: int, content_type: str, body: bytes) -> list[str]:
    """What breaks OpenAI's schemas in one response, a stream's every event included."""
    streamed = content_type.startswith("text/event-stream")
    name = response_schema(method, path, status, streamed)
    if name is None or not body:
        return []
    found: list[str] = []
    if streamed:
        for payload in sse_payloads(body):
            schema = "ErrorResponse" if isinstance(payload, dict) and "error" in payload else name
            found += [f"{method} {path} event: {line}" for line in problems(schema, payload)]
        return found
    if not content_type.startswith("application/json"):
        return [f"{method} {path}: {status} with content type {content_type!r}, not JSON"]
    return [f"{method} {path}: {line}" for line in problems(name, json.loads(body))]
