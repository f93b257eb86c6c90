"""What every route reads: the engine's public face, the observability holder, the options."""

from __future__ import annotations

import logging
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


class HeldPlaces:
    """Generation requests the HTTP layer holds: tokenizing, or in the engine.

    Counted so that a request beyond the engine's capacity is refused before
    its prompt is tokenized. Every engine request comes from a
    held place, so this count is never below the engine's own.
    """

    def __init__(self) -> None:
        self.count = 0


@dataclass(frozen=True)
class ServerContext:
    engine: EngineApi
    observability: Observability
    options: ServerOptions
    tokens: Tokens = field(default_factory=Tokens)
    places: HeldPlaces = field(default_factory=HeldPlaces)
