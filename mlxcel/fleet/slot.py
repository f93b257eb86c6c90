"""One model of a fleet: how it is served (:class:`ModelParts` for generation, :class:`EmbeddingParts`) and,
while loaded, its engine and app."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import trio

from ..embeddings.checkpoint import EmbeddingModel
from ..embeddings.engine import EmbeddingEngine
from ..embeddings.layout import embedding_working_bytes, is_embedding_checkpoint
from ..engine import Engine, WorkerSettings
from ..engine.instrument import Instrument
from ..models.images import FEATURE_CACHE_BYTES
from ..models.loader import CheckpointInfo
from ..observability import Observability
from ..policy import MtpPolicy, PolicySettings
from ..server import ServerOptions, create_app, create_embedding_app
from ..server.memory import MemoryLedger
from .catalog import ModelEntry
from .residency import Resident, charge


def model_charge(checkpoint: CheckpointInfo, worker: WorkerSettings) -> int:
    """What a generation model is charged against the memory budget while loaded: its weights, its standalone
    drafter's, its prefix cache's bound, and its images' features cache where it takes images."""
    drafter = worker.drafter.own_bytes() if worker.drafter is not None else 0
    return charge(checkpoint.weight_bytes, drafter, worker.prefix_cache_bytes) + \
        (FEATURE_CACHE_BYTES if worker.vision else 0)


class Engineish(Protocol):
    """What the fleet drives of a model's engine (:class:`~mlxcel.engine.Engine`, or an embedding model's)."""

    ready: trio.Event
    finished: trio.Event

    async def run(self) -> None: ...

    def stop(self, reason: str = ...) -> None: ...


class Parts(Protocol):
    """How one model is served, whatever its kind: what it is charged, and its engine and app when loaded."""

    @property
    def kind(self) -> str:
        """``generation`` or ``embedding``."""

    def weight_bytes(self) -> int: ...

    def charge(self) -> int: ...

    def start(self, name: str, blas: str | None, ledger: MemoryLedger | None
              ) -> tuple[Engineish, Observability, Any]: ...


@dataclass(frozen=True)
class ModelParts:
    """What serving one generation model takes: built from its catalog entry and the server's flags."""

    checkpoint: CheckpointInfo
    worker: WorkerSettings
    options: ServerOptions
    max_queue_depth: int
    kind: str = "generation"

    def weight_bytes(self) -> int:
        return self.checkpoint.weight_bytes + (self.worker.drafter.own_bytes() if self.worker.drafter else 0)

    def charge(self) -> int:
        """What this model is charged against the memory budget while loaded (:func:`model_charge`)."""
        return model_charge(self.checkpoint, self.worker)

    def start(self, name: str, blas: str | None, ledger: MemoryLedger | None,
              instrument: Instrument | None = None) -> tuple[Engine, Observability, Any]:
        """Its engine, observability and app (a fleet's member, or ``mlxcel serve``'s one model; *instrument*: the
        tests')."""
        observability = Observability(MtpPolicy(self.worker.policy).snapshot, model=name)
        observability.blas = blas
        engine = Engine(self.checkpoint, self.worker, observability, max_queue_depth=self.max_queue_depth,
                        instrument=instrument)
        return engine, observability, create_app(engine, observability, self.options, ledger)


@dataclass(frozen=True)
class EmbeddingParts:
    """What serving one embedding model takes."""

    model: EmbeddingModel
    options: ServerOptions
    policy: PolicySettings
    kind: str = "embedding"

    def weight_bytes(self) -> int:
        return self.model.weight_bytes

    def charge(self) -> int:
        """Its weights, and the working memory of its largest forward (:func:`embedding_working_bytes`)."""
        return self.model.weight_bytes + embedding_working_bytes(self.model.config, self.model.layout.max_tokens)

    def start(self, name: str, blas: str | None, ledger: MemoryLedger | None
              ) -> tuple[EmbeddingEngine, Observability, Any]:
        observability = Observability(MtpPolicy(self.policy).snapshot, model=name)
        observability.blas = blas
        engine = EmbeddingEngine(self.model, observability, self.policy)
        vocab = int(self.model.config.get("vocab_size", 0))
        return engine, observability, create_embedding_app(engine, observability, self.options, self.model.layout,
                                                           vocab, ledger)


class Slot:
    """One catalog entry and, while it is loaded, its engine and app."""

    def __init__(self, entry: ModelEntry, idle_unload: float | None) -> None:
        self.entry = entry
        self.kind = "embedding" if is_embedding_checkpoint(entry.path) else "generation"
        """Known from its files before it is looked at further (a small JSON read), so ``/v1/models`` says it."""
        self.idle_unload = entry.idle_unload if entry.idle_unload is not None else idle_unload
        self.state = "unloaded"
        """``unloaded``, ``loading``, ``loaded``, ``unloading`` or ``failed``."""
        self.error: str | None = None
        self.engine: Engineish | None = None
        self.app: Any = None
        self.observability: Observability | None = None
        self.busy = 0
        """Requests of its own in flight."""
        self.parts: Parts | None = None
        """How it is served, built (checkpoint inspected, drafter found) when it is first wanted."""
        self.building = trio.Lock()
        self.last_used = 0.0
        self.stopped = trio.Event()

    def resident(self) -> Resident:
        """As :mod:`.residency` sees it while loaded: charged its :meth:`ModelParts.charge`."""
        return Resident(self.entry.id, self.entry.pin, self.busy > 0 or self.state in ("loading", "unloading"),
                        self.last_used, self.idle_unload, self.parts.charge() if self.parts is not None else 0)

    def describe(self) -> dict[str, Any]:
        body: dict[str, Any] = {"id": self.entry.id, "object": "model", "created": 0, "owned_by": "mlxcel",
                                "names": [*self.entry.exact_names, *self.entry.patterns],
                                "loaded": self.state == "loaded", "state": self.state, "pinned": self.entry.pin,
                                "kind": self.kind}
        if self.parts is not None:
            body["weight_bytes"] = self.parts.weight_bytes()
            body["charged_bytes"] = self.parts.charge()
        limits = self.observability.limits if self.observability is not None else None
        if limits is not None and limits.token_bytes:
            body["cache_bytes"] = {"per_sequence": limits.sequence_bytes, "per_token": limits.token_bytes}
        if self.error is not None:
            body["error"] = self.error
        return body


def release_memory() -> None:
    """An unloaded model's arrays back to the system: collected, and mlx's buffer cache emptied."""
    import gc

    from ..engine.loading import clear_device_cache

    gc.collect()
    clear_device_cache()
