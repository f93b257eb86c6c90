"""The generation routes' wire: JSON request bodies in, server-sent events out, and a failed generation's error."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import trio
from quart import Response, request

from ..http.errors import ApiError, bad_request, shutting_down, unavailable
from .schemas import json_problem

if TYPE_CHECKING:
    from ..engine import Finish
    from .context import EngineApi

T = TypeVar("T")


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event carrying *payload* (JSON, or a literal like ``[DONE]``)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def event_stream(body: AsyncIterator[bytes]) -> Response:
    """A streamed answer of server-sent events, which no proxy should cache and no timeout may cut."""
    response = Response(body, content_type="text/event-stream")
    response.headers["Cache-Control"] = "no-cache"
    response.timeout = None
    return response


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _is_json(content_type: str | None) -> bool:
    """No ``Content-Type`` (taken as JSON, as FastAPI does), ``application/json`` or a ``+json`` type."""
    if not content_type:
        return True
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


LARGE_BODY = 64 * 1024
"""Bytes above which a body is parsed and validated in a worker thread: the walk of a 3 MB body holds the event
loop for about 0.4 s; in a thread the interpreter switches back to the loop every few milliseconds. 64 KiB, not
256: with twenty clients posting 94 KB schemas, ``/health`` took 30-40 ms at the median instead of 180-270
(``benchmarks/refused_schemas.py``'s ``deep`` case)."""


_LARGE_BODIES = trio.CapacityLimiter(1)
"""One large body at a time: each thread competes with the event loop for the GIL, and the loop gets it back
between the threads' turns, so more threads would only lengthen its waits."""


async def off_the_loop_if_large(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)``, in a worker thread when the request's body is large (:data:`LARGE_BODY`)."""
    if (request.content_length or 0) > LARGE_BODY:
        return await trio.to_thread.run_sync(function, *args, limiter=_LARGE_BODIES)
    return function(*args)


async def json_body(engine: EngineApi) -> dict[str, Any]:
    """The request's body: a JSON object mlxcel can serve, or a 400 ``invalid_json`` saying why not.

    The body is read first, so its size limit (413) comes before its type: a body declared as something other
    than JSON (a form, plain text) is a 415, as OpenAI and vLLM answer. JSON is UTF-8 (RFC 8259): a body in
    UTF-16 or UTF-32, which Python's parser would otherwise detect and accept, is a 400. A body still arriving
    when the server stops is a 503 at once: waiting for it could outlast the graceful shutdown, which would
    close the connection with no answer at all.
    """
    raw = None
    with engine.cancelled_on_stop():
        raw = await request.get_data(as_text=False)
    if raw is None:
        raise shutting_down(body_unread=True)
    assert isinstance(raw, bytes)
    return await off_the_loop_if_large(_parsed, raw, request.headers.get("Content-Type"))


def _parsed(raw: bytes, content_type: str | None) -> dict[str, Any]:
    if not _is_json(content_type):
        raise ApiError(415, f"the request body must be JSON (Content-Type: application/json), not "
                            f"{(content_type or '')[:100]!r}", code="unsupported_media_type")
    try:
        body = json.loads(raw.decode("utf-8").removeprefix("\ufeff"), parse_constant=_no_constants)
    except UnicodeDecodeError as exc:
        raise bad_request(f"the request body is not UTF-8 ({exc.reason} at byte {exc.start})",
                          code="invalid_json") from exc
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


def telling(failed: list[Finish | None]) -> Finish | None:
    """Of a request's failed choices, the first whose finish says why: the choices read after one failed (the
    reading stops there) have no finish of their own."""
    return next((finish for finish in failed if finish is not None), None)


def finish_error(finish: Finish | None, *, stopping: bool) -> tuple[ApiError, bool]:
    """The error for a request that did not finish normally, and whether its stream still ends with [DONE].

    The request's own fault (``error_type == "invalid_request_error"``) is a
    400 and the server's a 500; a stream then gets the error event and
    ``[DONE]``. A request ended by shutdown (*stopping*) is a 503 and its stream
    is cut without ``[DONE]``, the server is going away; so is a cancelled one
    (nobody is reading it) and one whose events stopped without a finish.
    """
    if finish is None:
        return unavailable("generation ended early", "generation_failed"), False
    if finish.reason == "cancelled" or stopping:
        return unavailable(finish.error or "generation ended early", "generation_failed"), False
    message = finish.error or "generation failed"
    if finish.error_type == "invalid_request_error":
        return bad_request(message, code="invalid_request"), True
    return ApiError(500, message, type="server_error", code="generation_failed"), True
