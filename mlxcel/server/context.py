"""What every route reads: the engine's public face, the observability holder, the options."""

from __future__ import annotations

import fnmatch
import logging
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import trio

from ..engine import Event, GenerationRequest
from ..observability import Observability
from .images import ImageLimits
from .memory import MemoryLedger
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

    def cancelled_on_stop(self) -> AbstractContextManager[trio.CancelScope]: ...


@dataclass(frozen=True)
class ServerOptions:
    model_name: str | None = None
    """The served model's name (the first ``--served-model-name``, else the model directory's); None on a router."""
    aliases: tuple[str, ...] = ()
    """Other names a request's ``model`` may use: the other served names, and the directory's."""
    patterns: tuple[str, ...] = ()
    """Shell-style patterns a request's ``model`` may match instead (a ``--models`` table's ``names``)."""
    available: tuple[str, ...] = ()
    """Every model the server serves, when it serves several (``--models``, ``--model-dir``): what a 404 lists."""
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
    memory_wait: float = 120.0
    """Seconds a request waits for room for its sequences' caches under a memory budget before a 503."""
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    image_prompt: Any = None
    """A vision model's :class:`~mlxcel.models.images.ImagePrompt` (its vision half loaded): requests may hold
    images; None: a request with one is a 400."""


def serves(options: ServerOptions, name: str) -> bool:
    """Whether a request naming the model *name* means the served one (``default`` always does)."""
    return name in (options.model_name, "default", *options.aliases) or any(
        fnmatch.fnmatchcase(name, pattern) for pattern in options.patterns)


def no_such_model(options: ServerOptions, name: str) -> str:
    """A 404's message for a request naming the model *name*, which no served model answers to."""
    served = ", ".join(repr(n) for n in options.available) if options.available else repr(options.model_name)
    return f"the model {name!r} does not exist; this server serves {served}"


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
    ledger: MemoryLedger | None = None
    """The memory budget's ledger (``--memory-budget``; a server of several models always has one), or None."""
