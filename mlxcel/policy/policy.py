"""The adaptive MTP policy: the statechart's model, its profiling window, its snapshots.

Pure Python: no MLX, no trio, no HTTP. The engine's worker thread owns one
:class:`MtpPolicy`, feeds it events, and consults :attr:`MtpPolicy.mtp_enabled`
before each B=1 burst; every event ends with a fresh frozen
:class:`~mlxcel.policy.snapshot.MtpPolicySnapshot` handed to ``publish``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from . import statechart as sc
from .batch_view import BatchView
from .estimator import ENABLE, BurstSample, acceptance_rate, decide, estimate_depth_limit, estimate_speedup
from .hints import Hint, HintStore, PairingKey
from .snapshot import MtpPolicySnapshot

logger = logging.getLogger(__name__)

#: Qualifying samples a profiling window needs before it settles.
DEFAULT_SAMPLES_REQUIRED = 4


@dataclass(frozen=True, slots=True)
class PolicySettings:
    """The operator's choices, as parsed from the environment (see ``mlxcel.config``)."""

    adaptive: bool = True
    """``MLXCEL_MTP_ADAPTIVE``: measure and persist a verdict."""
    pin: bool | None = None
    """``MLXCEL_ENABLE_MTP_B1``: None when unset, else what the pin resolved to."""
    allow_inexact: bool = False
    """``MLXCEL_MTP_ALLOW_INEXACT``: run the burst even when the exactness probe vetoes."""
    samples_required: int = DEFAULT_SAMPLES_REQUIRED

    def __post_init__(self) -> None:
        if self.samples_required < 1:
            raise ValueError("samples_required must be at least 1")


@dataclass(frozen=True, slots=True)
class HostInfo:
    """The serving host, as ``mlxcel.hardware`` reads it from the MLX backend."""

    label: str
    """The coarse hardware class that keys verdicts, e.g. ``M5-16c`` or ``cpu-Unknown-0c``."""
    gpu_vendor: str
    """``Apple``, ``Nvidia``, ``Amd`` or ``Unknown``."""
    gpu_device: str | None
    gpu_architecture: str | None
    static_mtp_gate: bool
    """The per-hardware default: on for Apple GPU generation >= 15, off elsewhere."""


#: What the policy reports about a host before any worker has looked at it.
UNKNOWN_HOST = HostInfo(label="Unknown-0c", gpu_vendor="Unknown", gpu_device=None,
                        gpu_architecture=None, static_mtp_gate=False)


@dataclass(frozen=True, slots=True)
class BootFacts:
    """What a worker knows once its model has loaded, for boot resolution."""

    host: HostInfo
    pairing: PairingKey | None
    """The (target, drafter, hardware, K) served, or None: no MTP dispatch."""
    probe_decline: str | None = None
    """The exactness probe's one-line reason when it vetoed the pairing, else None."""
    sharded: bool = False
    """The model is sharded across processes (``--distributed``): the B=1 burst cannot run."""


class MtpPolicy:
    """The running policy for one pairing.

    Events: :meth:`on_worker_ready` once the worker has loaded its model,
    :meth:`on_sample` after each qualifying B=1 burst, :meth:`on_worker_lost`
    when the worker goes away; each fires the statechart trigger of the same
    meaning (``resolve``, ``record_sample``, ``lose_worker``). The transitions
    library drives the state (the ``state`` attribute, e.g.
    ``"unavailable/worker_not_ready"``) through the arrows of
    :mod:`mlxcel.policy.statechart`, calling back into the condition methods
    named there. It also binds the bare triggers and ``is_<state>`` helpers
    onto the instance; use the ``on_*`` methods, which carry the event's data.

    Not thread-safe: one thread (the engine's worker) feeds it; other threads
    only read :attr:`snapshot`, which is replaced, never mutated.
    """

    state: str

    def __init__(self, settings: PolicySettings, hints: HintStore | None = None,
                 publish: Callable[[MtpPolicySnapshot], None] | None = None) -> None:
        self.settings = settings
        self._hints = hints
        self._publish = publish
        self._facts: BootFacts | None = None
        self._window: list[BurstSample] = []
        self._verdict: Hint | None = None  # in effect while settled: measured or restored
        self._batch: BatchView | None = None
        self._machine = sc.build_machine(self)
        self.snapshot = self._build_snapshot()

    # -- events -----------------------------------------------------------

    def on_worker_ready(self, facts: BootFacts) -> MtpPolicySnapshot:
        """Resolve the boot state from *facts*, first matching precedence row wins.

        Legal only while no worker is ready (``unavailable/worker_not_ready``):
        the statechart has no arrow from a resolved state back through
        ``resolve``. A worker that reloads calls :meth:`on_worker_lost` first,
        so readers see that nothing is known meanwhile.

        Raises:
            RuntimeError: a worker is already ready. Checked before anything
                changes: the policy, its snapshot and the published one stay as
                they were.
        """
        if self.state != sc.INITIAL:
            raise RuntimeError(f"MtpPolicy.on_worker_ready in state {self.state!r}: a worker is already "
                               "ready; call on_worker_lost first")
        self._facts = facts
        self._window.clear()
        self._verdict = None
        self._fire("resolve")
        return self.snapshot

    def on_sample(self, sample: BurstSample) -> MtpPolicySnapshot:
        """Count one qualifying B=1 burst. Ignored unless profiling."""
        if self.state != sc.PROFILING:
            return self.snapshot
        self._window.append(sample)
        self._log_sample()
        self._fire("record_sample")
        return self.snapshot

    def on_batch(self, view: BatchView | None) -> MtpPolicySnapshot:
        """What speculation inside the continuous batch does now (None: no batch), published beside the
        B=1 fields. Not a statechart event: the batch's rule measures and decides for itself."""
        self._batch = view
        self.publish()
        return self.snapshot

    def on_worker_lost(self) -> MtpPolicySnapshot:
        """The worker died or is restarting: back to ``unavailable/worker_not_ready``."""
        self._batch = None
        if self.state != sc.INITIAL:
            self._facts = None
            self._window.clear()
            self._verdict = None
            self._fire("lose_worker")
        return self.snapshot

    @property
    def mtp_enabled(self) -> bool | None:
        """The live gate: whether the policy is not blocking the B=1 burst right now.

        None only while no worker has resolved the policy. True while profiling
        (profiling forces MTP on); runtime gates below the policy may still
        refuse a burst.
        """
        state, facts = self.state, self._facts
        if facts is None or state in (sc.unavailable(sc.NO_MTP_DISPATCH), sc.unavailable(sc.SHARDED)):
            return None if facts is None else False
        if state == sc.unavailable(sc.ADAPTIVE_DISABLED):
            return self.settings.pin if self.settings.pin is not None else facts.host.static_mtp_gate
        if state == sc.FORCED:
            return bool(self.settings.pin)
        if state == sc.PROFILING:
            return True
        if state == sc.SETTLED:
            return self._verdict is not None and self._verdict.verdict == ENABLE
        return False  # exactness_declined

    @property
    def profiling(self) -> bool:
        """Whether the burst runs at full width for the window's samples (profiling forces MTP on)."""
        return self.state == sc.PROFILING

    @property
    def depth_limit(self) -> int | None:
        """Under a settled enable verdict, the context depth from which its samples estimate that the burst
        loses (the verify's attention over the context costs more than the drafts save): the prior of the
        draft-length rule at width 1 (:meth:`~.draft_length.DraftLength.choose`'s *parked_from*), which
        decides round by round where the burst runs. None otherwise."""
        verdict = self._verdict
        if self.state != sc.SETTLED or verdict is None or verdict.verdict != ENABLE:
            return None
        return verdict.depth_limit

    # -- the statechart's named conditions and callbacks --------------------

    def lacks_mtp_dispatch(self) -> bool:
        return self._facts is None or self._facts.pairing is None

    def runs_sharded(self) -> bool:
        return self._facts is not None and self._facts.sharded

    def adaptive_is_off(self) -> bool:
        return not self.settings.adaptive

    def operator_pinned(self) -> bool:
        return self.settings.pin is not None

    def probe_vetoed(self) -> bool:
        return self._facts is not None and self._facts.probe_decline is not None

    def inexact_allowed(self) -> bool:
        return self.settings.allow_inexact

    def hint_restored(self) -> bool:
        # Only reached once every row above has failed, so a corrupt hint is
        # only reported for a pairing that would actually use it.
        if self._hints is None or self._facts is None or self._facts.pairing is None:
            return False
        self._verdict = self._hints.load(self._facts.pairing)
        return self._verdict is not None

    def window_full(self) -> bool:
        return len(self._window) >= self.settings.samples_required

    def settle(self) -> None:
        """Compute the verdict from the full window and persist it."""
        assert self._facts is not None and self._facts.pairing is not None
        rate = acceptance_rate(self._window)
        speedup = estimate_speedup(self._window)
        depth = estimate_depth_limit(self._window)
        if depth is not None:
            # Samples on both sides of the crossing: the window's medians are right for neither side.
            # The verdict is taken where the lines say the burst pays most (the shallowest traffic
            # seen), and the limit keeps the burst off past the crossing.
            speedup = depth.shallow_speedup
        verdict = decide(speedup, self._facts.host.static_mtp_gate)
        limit = depth.depth if depth is not None and verdict == ENABLE else None
        self._verdict = Hint(key=self._facts.pairing, verdict=verdict,
                             acceptance_rate=round(rate if rate is not None else 0.0, 2),
                             samples=len(self._window),
                             estimated_speedup=None if speedup is None else round(speedup, 2),
                             depth_limit=limit)
        path = self._hints.save(self._verdict) if self._hints is not None else None
        logger.info("MTP policy settled: %s (acceptance %.2f, estimated speedup %s over %d samples%s); %s",
                    verdict, self._verdict.acceptance_rate, _speedup_text(speedup), len(self._window),
                    "" if limit is None else f"; the burst is skipped from {limit} tokens of context",
                    f"hint written to {path}" if path else "verdict kept in memory")

    def publish(self) -> None:
        """Runs after every event: build the snapshot and hand it on."""
        self.snapshot = self._build_snapshot()
        if self._publish is not None:
            self._publish(self.snapshot)

    # -- internals -----------------------------------------------------------

    def _fire(self, trigger: str) -> None:
        previous = self.state
        self._machine.trigger_event(self, trigger)
        if self.state != previous:
            self._log_state()

    def _log_state(self) -> None:
        snap = self.snapshot
        if snap.state == sc.EXACTNESS_DECLINED:
            # The same sentence as the body's decline_detail.
            logger.warning("MTP exactness probe declined the pairing: %s", snap.decline_detail)
        elif snap.state == sc.PROFILING:
            logger.info("MTP policy profiling %s + %s on %s at K=%s: %d single-request samples needed",
                        snap.target, snap.drafter, snap.hardware, snap.block_size, snap.samples_required)
        elif snap.state == sc.SETTLED and self._window == []:
            logger.info("MTP policy restored verdict %s (acceptance %.2f, %d samples) "
                        "for %s + %s on %s at K=%s",
                        snap.verdict, snap.acceptance_rate or 0.0, snap.samples,
                        snap.target, snap.drafter, snap.hardware, snap.block_size)
        elif snap.state != sc.SETTLED:
            logger.info("MTP policy %s%s (MTP %s)", snap.state,
                        f"/{snap.reason}" if snap.reason else "",
                        {True: "on", False: "off", None: "unknown"}[snap.mtp_enabled])

    def _log_sample(self) -> None:
        rate = acceptance_rate(self._window)
        logger.info("MTP policy sample %d/%d: acceptance %.2f so far, estimated speedup %s",
                    len(self._window), self.settings.samples_required, rate or 0.0,
                    _speedup_text(estimate_speedup(self._window)))

    def _build_snapshot(self) -> MtpPolicySnapshot:
        top, _, reason = self.state.partition(sc.SEPARATOR)
        facts = self._facts
        host = facts.host if facts is not None else UNKNOWN_HOST
        # Pairing fields exist once a worker serves an MTP pairing.
        key = facts.pairing if facts is not None else None
        profiling = top == sc.PROFILING
        verdict = self._verdict if top == sc.SETTLED else None
        if profiling:
            rate, speedup, samples = (acceptance_rate(self._window),
                                      estimate_speedup(self._window), len(self._window))
        elif verdict is not None:
            rate, speedup, samples = verdict.acceptance_rate, verdict.estimated_speedup, verdict.samples
        else:
            rate, speedup, samples = None, None, 0
        required = self.settings.samples_required
        return MtpPolicySnapshot(
            state=top,
            reason=reason or None,
            decline_detail=facts.probe_decline if facts and top == sc.EXACTNESS_DECLINED else None,
            verdict=verdict.verdict if verdict else None,
            mtp_enabled=self.mtp_enabled,
            target=key.target if key else None,
            drafter=key.drafter if key else None,
            hardware=key.hardware if key else None,
            gpu_vendor=host.gpu_vendor,
            gpu_device=host.gpu_device,
            gpu_architecture=host.gpu_architecture,
            block_size=key.block_size if key else None,
            acceptance_rate=rate,
            samples=samples,
            samples_required=required,
            samples_remaining=required - samples if profiling else None,
            estimated_speedup=speedup,
            depth_limit=verdict.depth_limit if verdict is not None else None,
            batch=self._batch if facts is not None else None,
        )


def _speedup_text(speedup: float | None) -> str:
    return "unknown (no classic-step probe)" if speedup is None else f"{speedup:.2f}x"
