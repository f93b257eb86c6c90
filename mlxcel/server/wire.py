"""The generation routes' wire: JSON request bodies in, server-sent events out."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from typing import Any, TypeVar

import trio
from quart import request

from .errors import bad_request
from .schemas import json_problem

T = TypeVar("T")


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event carrying *payload* (JSON, or a literal like ``[DONE]``)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


async def json_body() -> dict[str, Any]:
    """The request's body: a JSON object mlxcel can serve, or a 400 ``invalid_json`` saying why not."""
    raw = await request.get_data(as_text=False)
    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except RecursionError as exc:  # the C parser's own depth guard, at about 1,000 levels
        raise bad_request("the request body nests arrays and objects too deeply", code="invalid_json") from exc
    except ValueError as exc:  # not JSON, not UTF-8, NaN/Infinity, an integer of over 4,300 digits
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    problem = json_problem(body)
    if problem is not None:
        raise bad_request(problem, code="invalid_json")
    return body


async def replayed(held: list[T], events: trio.MemoryReceiveChannel[T]) -> AsyncGenerator[T, None]:
    """*held* events, then the rest of *events*."""
    for item in held:
        yield item
    async for item in events:
        yield item
