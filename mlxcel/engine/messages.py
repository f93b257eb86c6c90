"""What the worker is configured with and what it is sent: plain data, no mlx."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..distributed import World
from ..models.drafters import DrafterSpec
from ..policy import PolicySettings
from .requests import GenerationRequest


class LoadCancelled(Exception):
    """The server was stopped while the model was loading."""


@dataclass(frozen=True, slots=True)
class WorkerSettings:
    parallel: int = 4
    """Sequences that decode together (1 with ``--no-batch``)."""
    batch: bool = True
    """False (``--no-batch``): one slot, sequences decode one at a time, and no MTP drafter is loaded."""
    prefix_cache_entries: int | None = None
    """The prefix cache's bound in entries (``--prompt-cache-size``): None, bytes only; 0, no prefix cache."""
    prefix_cache_bytes: int = 1 << 30
    """The prefix cache's bound in bytes of KV caches (``--prompt-cache-bytes``)."""
    prefix_cache_disk_bytes: int = 0
    """Its disk tier's bound (``--prompt-cache-disk-bytes``), under *cache_root*; 0: no disk tier."""
    prefill_step_size: int = 512
    kv_bits: int | None = None
    """``--kv-bits``: the model's plain KV cache layers quantized to this many bits (mlx-lm's
    ``QuantizedKVCache``, group 64); None, full precision."""
    policy: PolicySettings = field(default_factory=PolicySettings)
    cache_root: Path | None = None
    """Where persisted policy hints live, or None to keep verdicts in memory."""
    drafter: DrafterSpec | None = None
    """The MTP drafter (``--mtp`` / ``--draft-model``), or None: no MTP dispatch."""
    block_size: int = 4
    """K, the verify width of a speculative round (K-1 drafts)."""
    draft_quantize: int | None = None
    """``--draft-quantize``: quantize the drafter's linear layers to this many bits at load (affine, group 64)."""
    sharding: World | None = field(default=None, compare=False)
    """``--distributed``: this rank's place in the group (rank 0 runs the worker), or None: one process."""
    vision: bool = False
    """Load the checkpoint's vision half beside its text model: requests may carry images."""
    measure_kv: bool = False
    """Measure at load what a sequence's cache holds (``ModelLimits.sequence_bytes`` and ``token_bytes``): a
    memory budget reserves it at admission."""


@dataclass(frozen=True, slots=True)
class Submit:
    request: GenerationRequest


@dataclass(frozen=True, slots=True)
class Cancel:
    request_id: str


@dataclass(frozen=True, slots=True)
class Stop:
    reason: str = "server shutting down"


@dataclass(frozen=True, slots=True)
class ReadDone:
    """An entry on the disk tier was read ahead (:mod:`.read_ahead`): the worker's own wake-up, from the
    reader thread, which the scheduler never sees."""


Message = Submit | Cancel | Stop
"""What the scheduler reads (:meth:`.scheduler.Scheduler.take`)."""
Inbound = Message | ReadDone
"""What the worker's inbox holds."""
