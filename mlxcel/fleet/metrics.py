"""``GET /metrics`` of a server of several models: the default model's own metrics, then the fleet's.

The fleet's gauges say what the issue asks the server to say of its memory: the budget, what the loaded
models are charged, what requests have reserved, what is free, and per model whether it is loaded and what it
is charged (``model`` label: its id). Another model's own metrics are ``/metrics?model=NAME``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ..server.memory import MemoryLedger
from .asgi import Receive, Scope, Send
from .slot import Slot


class FleetCollector(Collector):
    """Reads the slots and the ledger at each scrape (trio thread: the scrape runs there)."""

    def __init__(self, slots: Callable[[], list[Slot]], ledger: MemoryLedger | None) -> None:
        self._slots, self._ledger = slots, ledger

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self._ledger is not None:
            for name, value in self._ledger.to_json().items():
                gauge = GaugeMetricFamily(f"mlxcel_memory_{name}_bytes", f"Memory budget: {name}, in bytes")
                gauge.add_metric([], float(value))
                yield gauge
        loaded = GaugeMetricFamily("mlxcel_model_loaded", "Whether the model is loaded (1) or not (0)",
                                   labels=["model"])
        charged = GaugeMetricFamily("mlxcel_model_charged_bytes", "What the model is charged against the memory "
                                    "budget while loaded (weights, drafter, prefix cache bound)", labels=["model"])
        for slot in self._slots():
            loaded.add_metric([slot.entry.id], 1.0 if slot.state == "loaded" else 0.0)
            if slot.parts is not None:
                charged.add_metric([slot.entry.id], float(slot.parts.charge()))
        yield loaded
        yield charged


def fleet_registry(slots: Callable[[], list[Slot]], ledger: MemoryLedger | None) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(FleetCollector(slots, ledger))
    return registry


async def serve_metrics(default_app: Any, registry: CollectorRegistry, scope: Scope, receive: Receive,
                        send: Send) -> None:
    """The default model's metrics while it is loaded (its app's answer, kept), then the fleet's gauges."""
    own = b""
    if default_app is not None:
        answer: dict[str, Any] = {"status": 0, "body": b""}

        async def keep(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
            elif message["type"] == "http.response.body":
                answer["body"] += message.get("body", b"")

        await default_app(scope, receive, keep)
        if answer["status"] == 200:
            own = answer["body"]
    body = own + generate_latest(registry)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", CONTENT_TYPE_LATEST.encode()),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
