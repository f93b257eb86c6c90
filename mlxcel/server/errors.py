"""OpenAI-shaped errors: every error body is ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from quart import Response, jsonify

if TYPE_CHECKING:
    from ..engine import Finish


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


HTTP_ERROR_TYPES = {
    401: ("authentication_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "request_too_large"),
    503: ("server_error", "unavailable"),
}
