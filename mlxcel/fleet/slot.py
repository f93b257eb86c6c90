"""One model of a fleet: how it is served (:class:`ModelParts`) and, while loaded, its engine and app."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import trio

from ..engine import Engine, WorkerSettings
from ..models.loader import CheckpointInfo
from ..observability import Observability
from ..server import ServerOptions
from .catalog import ModelEntry
from .residency import Resident, charge


@dataclass(frozen=True)
class ModelParts:
    """What serving one model takes: built from its catalog entry and the server's flags."""

    checkpoint: CheckpointInfo
    worker: WorkerSettings
    options: ServerOptions
    max_queue_depth: int

    def drafter_bytes(self) -> int:
        return self.worker.drafter.own_bytes() if self.worker.drafter is not None else 0

    def charge(self) -> int:
        """What this model is charged against the memory budget while loaded."""
        return charge(self.checkpoint.weight_bytes, self.drafter_bytes(), self.worker.prefix_cache_bytes)


class Slot:
    """One catalog entry and, while it is loaded, its engine and app."""

    def __init__(self, entry: ModelEntry, idle_unload: float | None) -> None:
        self.entry = entry
        self.idle_unload = entry.idle_unload if entry.idle_unload is not None else idle_unload
        self.state = "unloaded"
        """``unloaded``, ``loading``, ``loaded``, ``unloading`` or ``failed``."""
        self.error: str | None = None
        self.engine: Engine | None = None
        self.app: Any = None
        self.observability: Observability | None = None
        self.busy = 0
        """Requests of its own in flight."""
        self.parts: ModelParts | None = None
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
                                "loaded": self.state == "loaded", "state": self.state, "pinned": self.entry.pin}
        if self.parts is not None:
            body["weight_bytes"] = self.parts.checkpoint.weight_bytes + self.parts.drafter_bytes()
            body["charged_bytes"] = self.parts.charge()
        limits = self.observability.limits if self.observability is not None else None
        if limits is not None and limits.token_bytes:
            body["cache_bytes"] = {"per_sequence": limits.sequence_bytes, "per_token": limits.token_bytes}
        if self.error is not None:
            body["error"] = self.error
        return body
