"""Profiling counts down, settles on the last sample, persists, and restores after a restart."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from mlxcel.policy import (
    ENABLE_AT_OR_ABOVE,
    HINT_VERSION,
    BootFacts,
    HintStore,
    MtpPolicy,
    MtpPolicySnapshot,
    PairingKey,
    PolicySettings,
)
from mlxcel.policy.cost_table import band_bounds, depth_band
from mlxcel.policy.draft_length import TRIALS, DraftLength
from mlxcel.policy.estimator import estimate_speedup
from tests.conftest import APPLE_M5, LINUX_CPU, validate_wire
from tests.policy.helpers import deep_sample, sample


def _profiling(cache: Path, key: PairingKey, published: list[MtpPolicySnapshot] | None = None,
               samples_required: int = 4) -> MtpPolicy:
    policy = MtpPolicy(PolicySettings(samples_required=samples_required), HintStore(cache),
                       publish=None if published is None else published.append)
    policy.on_worker_ready(BootFacts(host=APPLE_M5, pairing=key))
    return policy


def test_profiling_counts_down_and_settles_on_the_last_sample(cache_root: Path, pairing: PairingKey) -> None:
    published: list[MtpPolicySnapshot] = []
    policy = _profiling(cache_root, pairing, published)
    remaining = [policy.snapshot.samples_remaining]
    for _ in range(3):
        policy.on_sample(sample(accepted=2, proposed=3, speedup=2.0))
        remaining.append(policy.snapshot.samples_remaining)
        assert policy.snapshot.state == "profiling" and policy.mtp_enabled is True
    assert remaining == [4, 3, 2, 1]
    assert policy.snapshot.acceptance_rate == pytest.approx(2 / 3)  # raw running quotient

    policy.on_sample(sample(accepted=2, proposed=3, speedup=2.0))
    body = policy.snapshot.to_wire()
    validate_wire(body)
    assert (body["state"], body["verdict"], body["mtp_enabled"]) == ("settled", "enable", True)
    assert (body["acceptance_rate"], body["samples"], body["samples_remaining"]) == (0.67, 4, None)
    assert body["estimated_speedup"] == 2.0
    # Every event published a snapshot, the last one the settled state.
    assert [s.state for s in published] == ["profiling"] * 4 + ["settled"]
    assert published[-1] is policy.snapshot

    stored = json.loads(HintStore(cache_root).path_for(pairing).read_text())
    assert stored == {"version": HINT_VERSION, "target": "Gemma4-12B", "drafter": "Gemma4-12B-MTP",
                      "hardware": "M5-16c", "block_size": 4, "verdict": "enable",
                      "acceptance_rate": 0.67, "samples": 4, "estimated_speedup": 2.0,
                      "kernels": {}, "depth_limit": None}


def test_restart_restores_settled_without_profiling(cache_root: Path, pairing: PairingKey) -> None:
    first = _profiling(cache_root, pairing)
    for _ in range(4):
        first.on_sample(sample(accepted=1, proposed=3, speedup=0.8))
    settled = first.snapshot
    assert settled.verdict == "decline" and settled.mtp_enabled is False

    restarted = _profiling(cache_root, pairing)
    assert restarted.snapshot == settled
    # Settled policies take no more samples.
    restarted.on_sample(sample())
    assert restarted.snapshot == settled


@pytest.mark.parametrize("change", ["block_size", "hardware", "target", "drafter"])
def test_any_other_pairing_key_profiles_afresh(cache_root: Path, pairing: PairingKey, change: str) -> None:
    first = _profiling(cache_root, pairing)
    for _ in range(4):
        first.on_sample(sample())
    assert first.snapshot.state == "settled"

    other = {"block_size": 3, "hardware": "M4-10c", "target": "Other", "drafter": "Other-MTP"}[change]
    changed = PairingKey(**{**{f: getattr(pairing, f) for f in
                               ("target", "drafter", "hardware", "block_size")}, change: other})
    again = _profiling(cache_root, changed)
    assert (again.snapshot.state, again.snapshot.samples_remaining) == ("profiling", 4)


def test_verdict_comes_from_measurements(cache_root: Path, pairing: PairingKey) -> None:
    cpu_key = PairingKey("t", "d", LINUX_CPU.label, 4)
    verdicts = {}
    for speedup in (0.9, 1.05, 1.6):
        policy = MtpPolicy(PolicySettings(samples_required=2), None)
        policy.on_worker_ready(BootFacts(host=LINUX_CPU, pairing=cpu_key))
        for _ in range(2):
            policy.on_sample(sample(speedup=speedup))
        verdicts[speedup] = policy.snapshot.verdict
    # Below the decline line, in the ambiguous zone (static gate off on CPU), above the enable line.
    assert verdicts == {0.9: "decline", 1.05: "decline", 1.6: "enable"}


def test_ambiguous_zone_follows_the_static_gate_on_apple(pairing: PairingKey) -> None:
    policy = MtpPolicy(PolicySettings(samples_required=1), None)
    policy.on_worker_ready(BootFacts(host=APPLE_M5, pairing=pairing))
    policy.on_sample(sample(speedup=1.05))
    assert policy.snapshot.verdict == "enable"


def test_worker_loss_returns_to_not_ready_and_resolves_again(cache_root: Path, pairing: PairingKey) -> None:
    policy = _profiling(cache_root, pairing)
    policy.on_sample(sample())
    lost = policy.on_worker_lost()
    validate_wire(lost.to_wire())
    assert (lost.state, lost.reason, lost.mtp_enabled, lost.samples, lost.target) == (
        "unavailable", "worker_not_ready", None, 0, None)
    # The half-full window is gone with the worker: a new one starts from zero.
    policy.on_worker_ready(BootFacts(host=APPLE_M5, pairing=pairing))
    assert (policy.snapshot.state, policy.snapshot.samples) == ("profiling", 0)
    # Losing a worker that was never ready changes nothing.
    policy.on_worker_lost()
    assert policy.on_worker_lost() == policy.snapshot


@pytest.mark.parametrize("second", [None, "same"])
def test_a_second_ready_is_refused_and_changes_nothing(cache_root: Path, pairing: PairingKey,
                                                       second: str | None) -> None:
    published: list[MtpPolicySnapshot] = []
    policy = _profiling(cache_root, pairing, published, samples_required=2)
    policy.on_sample(sample(speedup=2.0))
    before, count = policy.snapshot, len(published)
    facts = BootFacts(host=LINUX_CPU, pairing=pairing if second else None)
    with pytest.raises(RuntimeError, match="already ready; call on_worker_lost first"):
        policy.on_worker_ready(facts)
    # Nothing moved: not the state, not the snapshot, nothing published, not the window.
    assert policy.state == "profiling" and policy.snapshot is before and len(published) == count
    assert (before.target, before.gpu_vendor, before.samples) == (pairing.target, "Apple", 1)
    policy.on_sample(sample(speedup=2.0))
    assert (policy.snapshot.state, policy.snapshot.samples) == ("settled", 2)
    # The documented way to re-resolve: lose the worker, then ready again.
    policy.on_worker_lost()
    policy.on_worker_ready(facts)
    assert policy.snapshot.state == ("settled" if second else "unavailable")


def test_unwritable_cache_keeps_the_verdict_in_memory(tmp_path: Path, pairing: PairingKey,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache directory should be")
    policy = _profiling(blocker / "cache", pairing)
    with caplog.at_level(logging.WARNING):
        for _ in range(4):
            policy.on_sample(sample())
    assert (policy.snapshot.state, policy.snapshot.verdict) == ("settled", "enable")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not persisting the MTP verdict" in warnings[0].getMessage()


def test_settling_logs_verdict_acceptance_speedup_and_hint_path(
        cache_root: Path, pairing: PairingKey, caplog: pytest.LogCaptureFixture) -> None:
    policy = _profiling(cache_root, pairing)
    with caplog.at_level(logging.INFO, logger="mlxcel.policy"):
        for _ in range(4):
            policy.on_sample(sample(speedup=1.75))
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("mlxcel")]
    assert "MTP policy sample 1/4: acceptance 0.67 so far, estimated speedup 1.75x" in messages
    settled = [m for m in messages if m.startswith("MTP policy settled")]
    assert settled == [
        "MTP policy settled: enable (acceptance 0.67, estimated speedup 1.75x over 4 samples); "
        f"hint written to {HintStore(cache_root).path_for(pairing)}"]


def test_an_enable_verdict_parks_the_lone_burst_from_its_depth_limit_across_a_restart(
        cache_root: Path, pairing: PairingKey) -> None:
    policy = _profiling(cache_root, pairing)
    for depth in (100, 2_000, 4_000, 6_000):
        assert policy.profiling and policy.mtp_enabled and policy.depth_limit is None  # every depth measured
        policy.on_sample(deep_sample(depth))
    body = policy.snapshot.to_wire()
    validate_wire(body)
    assert (body["state"], body["verdict"], body["mtp_enabled"]) == ("settled", "enable", True)
    limit = body["depth_limit"]
    assert limit == pytest.approx(10_000, abs=1)  # tests/policy/test_estimator.py: CROSSING
    assert policy.depth_limit == limit and not policy.profiling
    _assert_parks_from(limit)

    restarted = _profiling(cache_root, pairing)
    assert restarted.snapshot == policy.snapshot
    assert restarted.depth_limit == limit


def _assert_parks_from(limit: int) -> None:
    """The rule of K at width 1, given the verdict's limit as its prior: a depth past the limit, in a band
    where nothing speculative was measured, starts parked (the classic step, whatever is measured there during
    the cooldown); a shallow one measures and runs the K that pays."""
    rule = DraftLength(3)
    deep = band_bounds(depth_band(limit) + (band_bounds(depth_band(limit))[0] < limit))[0]  # wholly past it
    for depth in (deep, 100):
        first = rule.choose(1, depth, parked_from=limit)
        for _ in range(TRIALS):  # a classic step of 1 s, three drafts always kept in 1.2 s
            rule.classic(1, depth, 1.0)
            rule.speculative(1, depth, 3, 1.2, [3])
        assert (first, rule.choose(1, depth, parked_from=limit)) == ((0, 0) if depth == deep else (0, 3))


def test_a_window_that_loses_on_the_whole_but_pays_when_shallow_enables_below_its_limit(
        cache_root: Path, pairing: PairingKey) -> None:
    # Mostly deep traffic: the window's medians estimate about 1.03x, which on a CPU host (no static
    # gate) declines; the lines say 1.64x at 100 tokens of context and a loss from 10,000.
    policy = MtpPolicy(PolicySettings(), HintStore(cache_root))
    policy.on_worker_ready(BootFacts(host=LINUX_CPU, pairing=pairing))
    window = [deep_sample(d) for d in (100, 8_000, 9_000, 9_500)]
    assert 1.0 < estimate_speedup(window) < ENABLE_AT_OR_ABOVE  # type: ignore[operator]
    for burst in window:
        policy.on_sample(burst)
    snap = policy.snapshot
    assert (snap.verdict, snap.estimated_speedup) == ("enable", round(2.5 * 10.1 / 15.35, 2))
    assert snap.depth_limit == pytest.approx(10_000, abs=1) and policy.depth_limit == snap.depth_limit


def test_a_decline_or_a_pin_ignores_depth(cache_root: Path, pairing: PairingKey) -> None:
    declined = _profiling(cache_root, pairing)
    for _ in range(4):
        declined.on_sample(sample(speedup=0.8))
    assert declined.snapshot.depth_limit is None and declined.depth_limit is None and not declined.mtp_enabled

    pinned = MtpPolicy(PolicySettings(pin=True), HintStore(cache_root))
    pinned.on_worker_ready(BootFacts(host=LINUX_CPU, pairing=pairing))
    assert pinned.snapshot.state == "forced" and pinned.mtp_enabled and pinned.depth_limit is None
