"""Errors in the shape of the API asked: OpenAI's ``{"error": {"message", "type", "param", "code"}}``, or on
Anthropic's routes (``/v1/messages``) Anthropic's ``{"type": "error", "error": {"type", "message"}}``."""

from __future__ import annotations

from typing import Any

from quart import Response, jsonify, request


class ApiError(Exception):
    """An error a handler answers with; the app turns it into the OpenAI-shaped body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
"""Anthropic's error types by status; any other is an ``invalid_request_error`` below 500, an ``api_error``
from 500 on (a 405 is the client's mistake, not the server's)."""


def anthropic_body(error: ApiError) -> dict[str, Any]:
    kind = ANTHROPIC_TYPES.get(error.status, "invalid_request_error" if error.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response(error: ApiError) -> Response:
    anthropic = request.path == "/v1/messages" or request.path.startswith("/v1/messages/")
    response = jsonify(anthropic_body(error) if anthropic else error.body())
    response.status_code = error.status
    return response


def bad_request(message: str, *, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unavailable(message: str, code: str) -> ApiError:
    """503: the server cannot take this now (loading, at capacity, shutting down); a retry may work."""
    return ApiError(503, message, type="server_error", code=code)


def shutting_down(*, body_unread: bool = False) -> ApiError:
    """503 ``unavailable``: the server is stopping. *body_unread*: it stopped before the request's body had all
    arrived (answered at once: waiting for the rest could outlast the graceful period, which would close the
    connection with no answer)."""
    detail = "; the request's body had not all arrived" if body_unread else ""
    return unavailable(f"the server is shutting down{detail}", "unavailable")


HTTP_ERROR_TYPES = {
    401: ("authentication_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    503: ("server_error", "unavailable"),
}
