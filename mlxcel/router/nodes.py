"""The serving nodes behind a router: what the router knows of each, and the probe that refreshes it.

A probe reads, per node, ``/health`` (200 = healthy), ``/v1/internal/mtp-policy``
(through :func:`~mlxcel.router.policy_view.read_policy`) and the node's load:
``/metrics`` when it is mounted (the gateway gauges, or mlxcel's own batch and
queue gauges), else ``/slots``, else nothing (the router then knows only what
it sent itself).
"""

from __future__ import annotations

import fnmatch
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from ..fleet.catalog import is_pattern
from .policy_view import UNREADABLE, PolicyView, read_policy

logger = logging.getLogger(__name__)

HUNG_FIRST_SECONDS = 60.0
HUNG_MAX_SECONDS = 3600.0
#: Gauges a node's /metrics may carry, busy = running + waiting: the gateway names first, then mlxcel's own.
LOAD_GAUGES = (("vllm:num_requests_running", "vllm:num_requests_waiting"),
               ("mlxcel_batch_size", "mlxcel_queue_depth"))


@dataclass
class Node:
    """One serving node, as the router sees it. Mutated only on the trio thread."""

    id: str
    """``node-<i>``, in ``--backend`` order: what /router/stats and the ``X-Mlxcel-Node`` header show."""
    url: str
    healthy: bool = False
    in_flight: int = 0
    """Requests this router has open on the node."""
    served: int = 0
    failed: int = 0
    lost: int = 0
    """Requests in flight when the node failed: answered 502, never replayed on another node."""
    policy: PolicyView = UNREADABLE
    reported_busy: int | None = None
    """Running + waiting requests the node itself reported at the last probe (None: it reports none)."""
    reported_capacity: int | None = None
    """Its slot count, when /slots was read."""
    external: int = 0
    """What the node reported beyond this router's own requests at that moment: other clients' traffic."""
    last_error: str | None = None
    hung_until: float = -math.inf
    """trio time until which the node is out of rotation, a request on it having timed out (see mark_hung)."""
    hangs: int = 0
    """Timeouts in a row, none served since: each doubles the time out of rotation."""
    models: list[dict[str, Any]] | None = None
    """The model objects its ``/v1/models`` listed at the last probe (None: it lists none we can read)."""
    _load_source: str | None = field(default="/metrics", repr=False)
    """The load endpoint to try next; None once neither is mounted."""

    # The placement Candidate protocol.
    @property
    def available(self) -> bool:
        return self.healthy and not self.hung

    @property
    def hung(self) -> bool:
        return trio.current_time() < self.hung_until

    @property
    def load(self) -> int:
        """This router's open requests on the node plus the other traffic it last reported.

        The router's own count is exact and current; the node's report is up to one
        probe old, so only its excess over the router's count (at the time) is added.
        """
        return self.in_flight + self.external

    @property
    def capacity(self) -> int | None:
        return self.reported_capacity

    @property
    def runs_burst(self) -> bool:
        return self.policy.runs_burst

    def serves(self, model: str | None) -> bool:
        """Whether a request naming *model* may go here: any when it names none (or ``default``), or when the node
        lists no names (it predates them: it is asked and answers for itself)."""
        if model is None or model == "default" or self.models is None:
            return True
        names = [n for m in self.models for n in m.get("names") or [m.get("id")] if isinstance(n, str)]
        return any(model == n or (is_pattern(n) and fnmatch.fnmatchcase(model, n)) for n in names)

    def lose_request(self, error: str, *, timed_out: bool) -> None:
        """The node failed with one of this router's requests in flight (which is answered 502, never
        replayed); *timed_out*: it sent nothing for the read timeout (:meth:`mark_hung`)."""
        self.mark_failed(error)
        self.lost += 1
        if timed_out:
            self.mark_hung()

    def mark_hung(self) -> None:
        """A request on the node sent nothing for the read timeout: the node may answer ``/health`` and still
        never generate (its engine stuck), so probes cannot bring it back. Out of rotation for a minute, then
        two, four, ... (at most an hour) while it keeps timing out; an answered request resets that."""
        self.hangs += 1
        seconds = min(HUNG_MAX_SECONDS, HUNG_FIRST_SECONDS * 2 ** (self.hangs - 1))
        self.hung_until = trio.current_time() + seconds
        logger.warning("%s sent nothing for the read timeout: out of rotation for %g s", self.id, seconds)

    def mark_served(self) -> None:
        self.served += 1
        self.hangs = 0

    def mark_failed(self, error: str) -> None:
        """A request to the node failed on the transport: not tried again until a probe finds it healthy."""
        self.failed += 1
        self.healthy = False
        self.last_error = error
        logger.warning("%s failed: %s; routing around it until its /health answers", self.id, error)

    async def probe(self, client: httpx.AsyncClient, headers: dict[str, str], timeout: float) -> None:
        """Refresh health, policy and load. Never raises for anything the node does."""
        was = self.healthy
        try:
            health = await client.get(f"{self.url}/health", headers=headers, timeout=timeout)
            healthy = health.status_code == 200
            error = None if healthy else f"/health answered {health.status_code}"
        except httpx.HTTPError as exc:
            healthy, error = False, _describe(exc)
        if healthy:
            # Read before publishing health: a node that /router/stats and /health count as healthy
            # shows the policy it answered this round, never the placeholder from before its first.
            self.policy = await self._read_policy(client, headers, timeout)
            self.models = await self._read_models(client, headers, timeout)
        self.healthy, self.last_error = healthy, error
        if self.healthy != was:
            logger.info("%s is %s%s", self.id, "healthy" if self.healthy else "unhealthy",
                        "" if self.healthy else f" ({self.last_error})")
        if self.healthy:
            await self._read_load(client, headers, timeout)

    async def _read_policy(self, client: httpx.AsyncClient, headers: dict[str, str], timeout: float) -> PolicyView:
        try:
            response = await client.get(f"{self.url}/v1/internal/mtp-policy", headers=headers, timeout=timeout)
            if response.status_code != 200:
                return UNREADABLE
            return read_policy(response.json())
        except (httpx.HTTPError, ValueError):  # ValueError: not JSON
            return UNREADABLE

    async def _read_models(self, client: httpx.AsyncClient, headers: dict[str, str],
                           timeout: float) -> list[dict[str, Any]] | None:
        try:
            response = await client.get(f"{self.url}/v1/models", headers=headers, timeout=timeout)
            data = response.json().get("data") if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):  # not JSON, or not an object
            return self.models
        return [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)] \
            if isinstance(data, list) else None

    async def _read_load(self, client: httpx.AsyncClient, headers: dict[str, str], timeout: float) -> None:
        while self._load_source is not None:
            source = self._load_source
            try:
                response = await client.get(f"{self.url}{source}", headers=headers, timeout=timeout)
            except httpx.HTTPError:
                return
            if response.status_code == 404:  # not mounted on this node: try the next source from now on
                self._load_source = "/slots" if source == "/metrics" else None
                continue
            if response.status_code != 200:
                return
            busy = _busy_from_metrics(response.text) if source == "/metrics" else self._busy_from_slots(response)
            if busy is None and source == "/metrics":
                self._load_source = "/slots"
                continue
            self.reported_busy = busy
            self.external = max(0, (busy or 0) - self.in_flight)
            return

    def _busy_from_slots(self, response: httpx.Response) -> int | None:
        try:
            slots: Any = response.json()
        except ValueError:
            return None
        if not isinstance(slots, list):
            return None
        self.reported_capacity = len(slots)
        return sum(1 for s in slots if isinstance(s, dict) and s.get("is_processing") is True)


def _busy_from_metrics(text: str) -> int | None:
    """Running + waiting requests from a Prometheus text body, or None when it has neither gauge pair."""
    try:
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
    except ValueError:
        return None
    for running, waiting in LOAD_GAUGES:
        if running in values and waiting in values:
            return max(0, round(values[running] + values[waiting]))
    return None


def model_ids(nodes: list[Node]) -> list[str]:
    """Every model id the nodes listed, once each, in node order."""
    return list(dict.fromkeys(m["id"] for node in nodes for m in node.models or ()))


def models_body(nodes: list[Node]) -> dict[str, Any]:
    """The router's ``/v1/models``: the union of its nodes' lists, each model once, with the nodes that serve it
    (a model two nodes list is shown as the first listed it, with both node ids)."""
    merged: dict[str, dict[str, Any]] = {}
    for node in nodes:
        for model in node.models or ():
            entry = merged.setdefault(model["id"], {**model, "nodes": []})
            entry["nodes"].append(node.id)
    return {"object": "list", "data": list(merged.values())}


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def watch(nodes: list[Node], client: httpx.AsyncClient, headers: dict[str, str], *, interval: float,
                timeout: float, first_round: trio.Event) -> None:
    """Probe every node every *interval* seconds, all at once; *first_round* is set after the first."""
    while True:
        async with trio.open_nursery() as nursery:
            for node in nodes:
                nursery.start_soon(node.probe, client, headers, timeout)
        first_round.set()
        await trio.sleep(interval)


def stats_body(nodes: list[Node], decisions: dict[str, int], *, rerouted: int, rejected: int,
               placement: str, show_addresses: bool) -> dict[str, Any]:
    """The ``/router/stats`` body."""
    rows = []
    for node in nodes:
        row: dict[str, Any] = {
            "id": node.id, "healthy": node.healthy, "in_flight": node.in_flight, "served": node.served,
            "failed": node.failed, "lost": node.lost, "load": node.load, "reported_busy": node.reported_busy,
            "policy_state": node.policy.label(), "verdict": node.policy.verdict,
            "runs_burst": node.policy.runs_burst, "hung": node.hung,
        }
        if show_addresses:
            row["address"] = node.url
        rows.append(row)
    return {"role": "router", "placement": placement, "nodes": rows, "decisions": dict(decisions),
            "rerouted": rerouted, "rejected": rejected, "addresses_redacted": not show_addresses}
