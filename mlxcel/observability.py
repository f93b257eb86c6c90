"""What the engine publishes and the HTTP layer reads: no mlx, no trio.

The engine's worker thread writes whole immutable values (the policy snapshot
with its wire body, cache statistics, slot states) with single attribute
assignments; request
handlers only read them, so nothing here needs a lock and no handler ever
waits on the decode loop. Counters are prometheus_client metrics, which are
thread-safe.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .policy import MtpPolicySnapshot
from .policy.statechart import LEAF_STATES

EngineState = Literal["loading", "ready", "failed", "stopping"]


@dataclass(frozen=True, slots=True)
class CacheStats:
    entries: int = 0
    bytes: int = 0
    max_entries: int | None = None
    """None: bounded in bytes only."""
    max_bytes: int = 0
    lookups: int = 0
    hits: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0
    snapshots: int = 0
    """Copies of a live sequence's cache kept at a prompt position (caches that cannot be rewound)."""
    evictions: int = 0
    """Entries dropped from memory to keep within the bounds, least recently used first (to disk, if any)."""
    disk_hits: int = 0
    """Prompts that resumed from an entry read back from disk."""
    disk_entries: int = 0
    disk_bytes: int = 0
    max_disk_bytes: int = 0
    """0: no disk tier."""

    def to_json(self) -> dict[str, Any]:
        return {
            "entries": self.entries,
            "bytes": self.bytes,
            "max_entries": self.max_entries,
            "max_bytes": self.max_bytes,
            "lookups": self.lookups,
            "hits": self.hits,
            "misses": self.lookups - self.hits,
            "hit_rate": round(self.hits / self.lookups, 4) if self.lookups else None,
            "prompt_tokens": self.prompt_tokens,
            "reused_tokens": self.reused_tokens,
            "snapshots": self.snapshots,
            "evictions": self.evictions,
            "disk": {"entries": self.disk_entries, "bytes": self.disk_bytes, "max_bytes": self.max_disk_bytes,
                     "hits": self.disk_hits},
        }


@dataclass(frozen=True, slots=True)
class PublishedPolicy:
    """A policy snapshot with its wire body, serialised once per change rather than per poll."""

    snapshot: MtpPolicySnapshot
    wire: bytes


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What a request may ask of the loaded model, published by the worker once it has loaded."""

    vocab_size: int
    """Width of the logits (the largest ``top_k`` that means anything is one less)."""
    embedding_size: int
    """Rows of the input embedding: a prompt token id must be below it."""
    context_length: int
    snapshots: bool = False
    """The model's cache cannot be rewound (recurrent or convolution state, a ring): the prefix cache serves a
    later prompt from snapshots only, so a chat prompt carries the positions worth one (its checkpoints)."""
    sequence_bytes: int = 0
    """What one sequence's cache holds whatever its length (recurrent and convolution state, the first
    allocation of its KV), when measured (``WorkerSettings.measure_kv``); else 0."""
    token_bytes: float = 0.0
    """What each further token of a sequence adds to its cache (its KV), when measured; else 0."""

    def sequence_cost(self, tokens: int) -> int:
        """The bytes a sequence of at most *tokens* tokens may hold in its cache."""
        return self.sequence_bytes + round(self.token_bytes * min(tokens, self.context_length))


@dataclass(frozen=True, slots=True)
class SlotState:
    id: int
    is_processing: bool
    n_prompt_tokens: int = 0
    n_decoded: int = 0


class _PolicyStateCollector(Collector):
    """``mlxcel_mtp_policy_state{state=...}``: 1 for the current state, read at scrape time."""

    def __init__(self, observability: Observability) -> None:
        self._observability = observability

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self._observability.policy
        current = f"{snap.state}/{snap.reason}" if snap.reason else snap.state
        family = GaugeMetricFamily("mlxcel_mtp_policy_state", "Adaptive MTP policy state (1 = current)",
                                   labels=["state"])
        for state in LEAF_STATES:
            family.add_metric([state], 1.0 if state == current else 0.0)
        yield family
        enabled = GaugeMetricFamily("mlxcel_mtp_enabled", "The policy's live MTP gate (1 on, 0 off or unknown)")
        enabled.add_metric([], 1.0 if snap.mtp_enabled else 0.0)
        yield enabled


class _GatewayCollector(Collector):
    """The gauges inference gateways schedule on, under the names they read by default (docs/scaling.md).

    The Gateway API inference extension's model server protocol (and llm-d's
    scheduler, built on it) reads TotalQueuedRequests, TotalRunningRequests and
    KVCacheUtilization as vLLM names them. KV-cache use here is the tokens held
    by the sequences in the slots over the slots' whole context (``parallel`` x
    ``n_ctx``): mlxcel allocates KV per sequence, so that is the share of its
    budget in use, 0 to 1 as in vLLM. ``gpu_cache_usage_perc`` is the older name
    the same gauge had, still the default of older gateway releases.
    """

    def __init__(self, observability: Observability) -> None:
        self._observability = observability

    def collect(self) -> Iterator[GaugeMetricFamily]:
        o = self._observability
        labels = [o.model or ""]
        running = sum(1 for slot in o.slots if slot.is_processing)
        context = o.limits.context_length if o.limits is not None else 0
        held = sum(slot.n_prompt_tokens + slot.n_decoded for slot in o.slots if slot.is_processing)
        usage = min(1.0, held / (len(o.slots) * context)) if o.slots and context else 0.0
        for name, help_text, value in (
                ("vllm:num_requests_waiting", "Requests waiting for a decode slot", float(o.waiting)),
                ("vllm:num_requests_running", "Requests holding a decode slot", float(running)),
                ("vllm:kv_cache_usage_perc", "KV-cache use, 0 to 1 (tokens held over parallel x n_ctx)", usage),
                ("vllm:gpu_cache_usage_perc", "The same as vllm:kv_cache_usage_perc (its older name)", usage)):
            family = GaugeMetricFamily(name, help_text, labels=["model_name"])
            family.add_metric(labels, value)
            yield family


class _PrefixCacheCollector(Collector):
    """The prefix cache's figures (``/v1/cache/stats``), read at scrape time from the last published ones."""

    def __init__(self, observability: Observability) -> None:
        self._observability = observability

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._observability.cache
        for name, help_text, value in (
                ("mlxcel_prefix_cache_lookups", "Prompts looked up in the prefix cache", stats.lookups),
                ("mlxcel_prefix_cache_hits", "Prompts that resumed from a cached prefix", stats.hits),
                ("mlxcel_prefix_cache_reused_tokens", "Prompt tokens not prefilled, read from the prefix cache",
                 stats.reused_tokens),
                ("mlxcel_prefix_cache_snapshots", "Snapshots kept of caches that cannot be rewound",
                 stats.snapshots),
                ("mlxcel_prefix_cache_evictions", "Prefix cache entries evicted to keep within its bounds",
                 stats.evictions),
                ("mlxcel_prefix_cache_disk_hits", "Prompts that resumed from an entry read back from disk",
                 stats.disk_hits)):
            counter = CounterMetricFamily(name, help_text)
            counter.add_metric([], float(value))
            yield counter
        for name, help_text, value in (
                ("mlxcel_prefix_cache_entries", "Entries in the prefix cache", stats.entries),
                ("mlxcel_prefix_cache_bytes", "Bytes of caches the prefix cache holds", stats.bytes),
                ("mlxcel_prefix_cache_max_bytes", "The prefix cache's bound in bytes", stats.max_bytes),
                ("mlxcel_prefix_cache_disk_entries", "Entries in the prefix cache's disk tier", stats.disk_entries),
                ("mlxcel_prefix_cache_disk_bytes", "Bytes of the prefix cache's disk tier", stats.disk_bytes)):
            gauge = GaugeMetricFamily(name, help_text)
            gauge.add_metric([], float(value))
            yield gauge


#: The generation rate the page plots: tokens per second over spans of this many seconds, this many spans.
RATE_SECONDS = 5
RATE_BUCKETS = 60


class Observability:
    """The last published state of the engine, and the server's metrics."""

    def __init__(self, policy: MtpPolicySnapshot, model: str | None = None) -> None:
        self.publish_policy(policy)
        self.model = model
        self.state: EngineState = "loading"
        self.loading: str | None = None
        """While the worker loads, the last progress line it logged (what ``/health`` says it is doing), else None."""
        self.error: str | None = None
        self.cache = CacheStats()
        self.slots: tuple[SlotState, ...] = ()
        self.waiting = 0
        """Requests held beyond the slots (waiting for one)."""
        self.limits: ModelLimits | None = None
        """None until the model has loaded."""
        self.blas: str | None = None
        self.started = time.time()
        self.errors: deque[tuple[float, str, int]] = deque(maxlen=20)
        """The last error answers: (unix time, route rule, status), never what the request held."""
        self._made: deque[list[int]] = deque(maxlen=RATE_BUCKETS)  # [bucket (monotonic // RATE_SECONDS), tokens]
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("mlxcel_requests", "HTTP requests answered", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("mlxcel_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generated_tokens = Counter("mlxcel_generated_tokens", "Tokens generated", registry=r)
        self.draft_tokens = Counter("mlxcel_draft_tokens", "Draft tokens proposed", registry=r)
        self.draft_accepted = Counter("mlxcel_draft_tokens_accepted", "Draft tokens accepted", registry=r)
        self.handoffs = Counter("mlxcel_solo_handoffs", "Sequences moved from solo decode into the batch",
                                registry=r)
        self.batch_steps = Counter("mlxcel_batch_steps", "Steps of the continuous batch, by drafts verified per "
                                   "row (0: the classic step)", ["drafts"], registry=r)
        self.lone_steps = Counter("mlxcel_lone_steps", "A lone request's burst's rounds by drafts verified (0: a "
                                  "classic step inside the burst)", ["drafts"], registry=r)
        self.queue_depth = Gauge("mlxcel_queue_depth", "Requests waiting for a decode slot", registry=r)
        self.batch_size = Gauge("mlxcel_batch_size", "Sequences decoding together", registry=r)
        # Generations take seconds to minutes: prometheus' default buckets stop at 10 s.
        self.request_seconds = Histogram("mlxcel_request_seconds", "Generation request duration",
                                         buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
                                         registry=r)
        r.register(_PolicyStateCollector(self))
        r.register(_GatewayCollector(self))
        r.register(_PrefixCacheCollector(self))

    def publish_load(self, sequences: list[tuple[int, int]], parallel: int, reading: int = 0) -> None:
        """Slots, batch size and queue depth from the (prompt tokens, decoded) of every sequence held,
        those decoding first: the first *parallel* hold the slots, the rest wait; and *reading* arrivals wait
        too, for their prompt cache entries (:mod:`.engine.read_ahead`)."""
        serving = sequences[:parallel]
        self.slots = tuple(SlotState(id=i, is_processing=i < len(serving),
                                     n_prompt_tokens=serving[i][0] if i < len(serving) else 0,
                                     n_decoded=serving[i][1] if i < len(serving) else 0)
                           for i in range(parallel))
        self.waiting = len(sequences) - len(serving) + reading
        self.batch_size.set(len(serving))
        self.queue_depth.set(self.waiting)

    def count_generated(self) -> None:
        """One token generated (on the engine's thread): the counter, and the rate over the last minutes."""
        self.generated_tokens.inc()
        bucket = int(time.monotonic() // RATE_SECONDS)
        if self._made and self._made[-1][0] == bucket:
            self._made[-1][1] += 1
        else:
            self._made.append([bucket, 1])

    def generated_by_span(self) -> dict[str, Any]:
        """Tokens generated in each of the last :data:`RATE_BUCKETS` spans of :data:`RATE_SECONDS`, oldest first,
        the current one last with the seconds it has run so far (a rate divides by those, not by a whole span)."""
        clock = time.monotonic()
        now = int(clock // RATE_SECONDS)
        made = {bucket: count for bucket, count in list(self._made)}
        counts = [made.get(bucket, 0) for bucket in range(now - RATE_BUCKETS + 1, now + 1)]
        return {"span_seconds": RATE_SECONDS, "counts": counts, "current_span_seconds": round(clock % RATE_SECONDS, 3)}

    def status_json(self) -> dict[str, Any]:
        """What the page at ``GET /`` shows of the server (``/v1/internal/server-status``): the engine's state,
        requests running and queued, the token counters, the generation rate over the last five minutes and the
        last errors."""
        samples = {s.name: s.value for metric in (self.prompt_tokens, self.generated_tokens, self.draft_tokens,
                                                  self.draft_accepted) for family in metric.collect()
                   for s in family.samples}

        def total(name: str) -> int:
            return int(samples.get(f"{name}_total", 0))

        return {"model": self.model, "state": self.state, "uptime_seconds": round(time.time() - self.started, 1),
                "requests": {"running": sum(slot.is_processing for slot in self.slots), "queued": self.waiting,
                             "slots": len(self.slots)},
                "tokens": {"prompt": total("mlxcel_prompt_tokens"), "generated": total("mlxcel_generated_tokens"),
                           "drafted": total("mlxcel_draft_tokens"), "accepted": total("mlxcel_draft_tokens_accepted")},
                "generated_by_span": self.generated_by_span(),
                "errors": [{"at": round(at, 3), "route": route, "status": status}
                           for at, route, status in reversed(self.errors)]}

    def publish_policy(self, snapshot: MtpPolicySnapshot) -> None:
        """Swap in a new policy snapshot and its wire body, in one assignment."""
        self.published = PublishedPolicy(snapshot, json.dumps(snapshot.to_wire(), separators=(",", ":")).encode())

    @property
    def policy(self) -> MtpPolicySnapshot:
        return self.published.snapshot

    @property
    def policy_wire(self) -> bytes:
        return self.published.wire
