"""The published policy state: one frozen snapshot, two renderings."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from .batch_view import BatchView

#: Wire schema version of the ``/v1/internal/mtp-policy`` body. Independent of
#: the persisted hint's ``HINT_VERSION``. Bump only for breaking changes.
SCHEMA_VERSION = 1

#: The ``unavailable`` reason of a model a several-model server serves but has not loaded (or has unloaded):
#: no policy runs for it, so it is no state of the statechart; the contract lets reasons grow.
NOT_LOADED = "not_loaded"


@dataclass(frozen=True, slots=True)
class MtpPolicySnapshot:
    """The policy's state as published after a transition.

    Fields are declared in the contract's documented order, which is the order
    of the wire body. The null rules (``reason`` only when unavailable,
    ``samples_remaining`` only while profiling, ...) are the policy's to
    uphold when it builds a snapshot; the renderings only lay it out.
    """

    state: str
    reason: str | None
    decline_detail: str | None
    verdict: str | None
    mtp_enabled: bool | None
    target: str | None
    drafter: str | None
    hardware: str | None
    gpu_vendor: str
    gpu_device: str | None
    gpu_architecture: str | None
    block_size: int | None
    acceptance_rate: float | None
    samples: int
    samples_required: int
    samples_remaining: int | None
    # Added to schema 1 (new fields are allowed within a version): the speedup
    # the verdict was computed from; running while profiling, two decimals once
    # settled, null when nothing was measured.
    estimated_speedup: float | None
    # Added to schema 1 as well: the context length (tokens) from which a settled
    # enable verdict's samples estimate the burst stops paying: a lone request there
    # starts classic (the rule of K's prior at width 1, which measures it again);
    # null when the burst pays at every depth, and in every other state.
    depth_limit: int | None = None
    # Added to schema 1 too: speculation inside the continuous batch (the widths and depths at which it runs, a
    # lone request's burst as width 1); null where the server has no batch. Not the statechart's: the rule of K
    # measures for itself.
    batch: BatchView | None = None

    def not_loaded(self) -> MtpPolicySnapshot:
        """What the endpoint says of a model that is not loaded: this snapshot (a fresh policy's, before its worker
        is ready) with the reason :data:`NOT_LOADED`; nothing of a pairing is known."""
        return replace(self, reason=NOT_LOADED, mtp_enabled=None, target=None, drafter=None, hardware=None,
                       block_size=None)

    def to_wire(self) -> dict[str, Any]:
        """The schema-v1 body of ``GET /v1/internal/mtp-policy``."""
        body = {"schema_version": SCHEMA_VERSION, **asdict(self)}
        body["batch"] = self.batch.to_wire() if self.batch is not None else None
        return body

    def to_health(self) -> dict[str, Any]:
        """The unversioned ``observability.mtp_policy`` shape of ``/health``.

        ``state`` is spelled ``status``; there is no ``schema_version`` and no
        ``samples_remaining``. An operator surface with no stability promise.
        """
        body = asdict(self)
        del body["samples_remaining"]
        body["batch"] = self.batch.to_wire() if self.batch is not None else None
        return {"status": body.pop("state"), **body}
