"""OpenAI-shaped errors: every error body is ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import Any

from quart import Response, jsonify


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


def error_response(error: ApiError) -> Response:
    response = jsonify(error.body())
    response.status_code = error.status
    return response


def bad_request(message: str, *, param: str | None = None, code: str = "invalid_request") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def unavailable(message: str, code: str) -> ApiError:
    """503: the server cannot take this now (loading, at capacity, shutting down); a retry may work."""
    return ApiError(503, message, type="server_error", code=code)


HTTP_ERROR_TYPES = {
    401: ("authentication_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    503: ("server_error", "unavailable"),
}
