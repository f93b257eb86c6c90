"""What every route reads: the engine's public face, the observability holder, the options.

Also the per-request scope (:func:`at_request_end`): cleanups that run when
the ASGI call for a request returns, however it ends. A streamed response's
body generator cannot be relied on for that: when the client leaves before
Quart starts iterating it, the generator never starts and its ``finally``
never runs (review D15).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import trio

from ..engine import Event, GenerationRequest
from ..observability import Observability
from .tokens import Tokens

logger = logging.getLogger(__name__)


class EngineApi(Protocol):
    """The engine as the HTTP layer sees it (see :class:`mlxcel.engine.Engine`)."""

    tokenizer: Any
    grammar_tokenizer: Any
    """llguidance's tokenizer, built at load, or a sentence (a str) saying why there is none."""
    ready: trio.Event
    capacity: int

    def submit(self, request: GenerationRequest) -> trio.MemoryReceiveChannel[Event]: ...

    def cancel(self, request_id: str) -> None: ...


@dataclass(frozen=True)
class ServerOptions:
    model_name: str | None = None
    """The served model id (the model directory basename); None on a router."""
    model_path: Path | None = None
    context_length: int = 4096
    parallel: int = 1
    default_max_tokens: int = 512
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 1024 * 1024
    props: bool = False
    slots: bool = False
    metrics: bool = False
    extra_props: dict[str, Any] = field(default_factory=dict)


class Admission:
    """Generation requests the HTTP layer holds: tokenizing, or in the engine.

    Counted so that a request beyond the engine's capacity is refused before
    its prompt is tokenized (review D18). Every engine request comes from a
    held place, so this count is never below the engine's own.
    """

    def __init__(self) -> None:
        self.held = 0


@dataclass(frozen=True)
class ServerContext:
    engine: EngineApi
    observability: Observability
    options: ServerOptions
    tokens: Tokens = field(default_factory=Tokens)
    admission: Admission = field(default_factory=Admission)


_cleanups: contextvars.ContextVar[list[Callable[[], None]]] = contextvars.ContextVar("mlxcel_request_cleanups")


def at_request_end(cleanup: Callable[[], None]) -> None:
    """Run *cleanup* when this HTTP request's ASGI call returns: sent, failed, or cancelled.

    Registering has no checkpoint, so nothing can come between the action it
    undoes and the registration. Without a scope (the app is not wrapped by
    :class:`RequestScope`) this is an error: a cleanup that never runs is a leak.
    """
    _cleanups.get().append(cleanup)


class RequestScope:
    """ASGI middleware that gives every HTTP request a list of cleanups, run when its call returns.

    The list is set in a context variable before the app runs; quart-trio's
    request tasks are spawned from this task, so they see the same list.
    """

    def __init__(self, app: Callable[..., Any]) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        cleanups: list[Callable[[], None]] = []
        token = _cleanups.set(cleanups)
        try:
            await self.app(scope, receive, send)
        finally:
            _cleanups.reset(token)
            for cleanup in cleanups:
                try:
                    cleanup()
                except Exception:  # one failed cleanup must not skip the others
                    logger.exception("a request cleanup failed")
