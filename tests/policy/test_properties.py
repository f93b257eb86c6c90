"""Any sequence of events keeps the published body within the contract's rules."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxcel.policy import (
    BootFacts,
    BurstSample,
    HintStore,
    MtpPolicy,
    MtpPolicySnapshot,
    PairingKey,
    PolicySettings,
)
from mlxcel.policy.estimator import decide, estimate_speedup
from tests.conftest import APPLE_M5, LINUX_CPU, validate_wire

keys = st.builds(PairingKey, target=st.sampled_from(["a", "b"]), drafter=st.just("a-mtp"),
                 hardware=st.sampled_from([APPLE_M5.label, LINUX_CPU.label]),
                 block_size=st.integers(2, 5))
boots = st.builds(BootFacts, host=st.sampled_from([APPLE_M5, LINUX_CPU]), pairing=st.none() | keys,
                  probe_decline=st.none() | st.just("verify block position 0 differs"), sharded=st.booleans())


@st.composite
def samples(draw: st.DrawFn) -> BurstSample:
    rounds = draw(st.integers(1, 50))
    proposed = draw(st.integers(rounds, rounds * 4))
    return BurstSample(
        rounds=rounds, proposed=proposed, accepted=draw(st.integers(0, proposed)),
        round_seconds=draw(st.floats(0, 5)), classic_steps=(steps := draw(st.integers(0, 4))),
        classic_seconds=draw(st.floats(0, 1)) if steps else 0.0)


events = st.lists(st.one_of(boots.map(lambda b: ("ready", b)), samples().map(lambda s: ("sample", s)),
                            st.just(("lost", None))), max_size=30)
policy_settings = st.builds(PolicySettings, adaptive=st.booleans(), pin=st.none() | st.booleans(),
                            allow_inexact=st.booleans(), samples_required=st.integers(1, 5))
# Where profiling can happen (adaptive on, no pin, a pairing), with mostly samples:
# sequences of the general kind rarely fill a window (about 1 in 150 examples).
measuring_settings = st.builds(PolicySettings, allow_inexact=st.booleans(), samples_required=st.integers(1, 5))
_paired_boots = st.builds(BootFacts, host=st.sampled_from([APPLE_M5, LINUX_CPU]), pairing=keys,
                          probe_decline=st.none() | st.just("verify block position 0 differs"))
_event_of_kind = {"ready": _paired_boots.map(lambda b: ("ready", b)), "sample": samples().map(lambda s: ("sample", s)),
                  "lost": st.just(("lost", None))}
measuring_events = st.lists(st.sampled_from(["ready", "sample", "sample", "sample", "sample", "lost"])
                            .flatmap(_event_of_kind.__getitem__), min_size=4, max_size=30)


class Reference:
    """The policy as the architecture doc describes it, kept by hand from the same events.

    It shares nothing with MtpPolicy but the estimator's verdict rule
    (``decide(estimate_speedup(window))``, tested on its own in
    test_estimator.py): the boot precedence, the window, the persisted
    verdicts and the live gate are all written out here again.
    """

    def __init__(self, settings: PolicySettings) -> None:
        self.settings = settings
        self.boot: BootFacts | None = None
        self.window: list[BurstSample] = []
        self.state, self.reason = "unavailable", "worker_not_ready"
        self.verdict: tuple[str, int] | None = None  # (verdict, samples) while settled
        self.stored: dict[PairingKey, tuple[str, int]] = {}  # what the hint store holds by now

    def ready(self, boot: BootFacts) -> None:
        self.boot, self.window, self.verdict, self.reason = boot, [], None, None
        pairing, settings = boot.pairing, self.settings
        if pairing is None:
            self.state, self.reason = "unavailable", "no_mtp_dispatch"
        elif boot.sharded:
            self.state, self.reason = "unavailable", "sharded"
        elif not settings.adaptive:
            self.state, self.reason = "unavailable", "adaptive_disabled"
        elif settings.pin is not None:
            self.state = "forced"
        elif boot.probe_decline is not None and not settings.allow_inexact:
            self.state = "exactness_declined"
        elif pairing in self.stored:
            self.state, self.verdict = "settled", self.stored[pairing]
        else:
            self.state = "profiling"

    def sample(self, sample: BurstSample) -> None:
        if self.state != "profiling":
            return
        self.window.append(sample)
        if len(self.window) == self.settings.samples_required:
            assert self.boot is not None and self.boot.pairing is not None
            verdict = decide(estimate_speedup(self.window), self.boot.host.static_mtp_gate)
            self.state, self.verdict = "settled", (verdict, len(self.window))
            self.stored[self.boot.pairing] = self.verdict

    def lost(self) -> None:
        self.boot, self.window, self.verdict = None, [], None
        self.state, self.reason = "unavailable", "worker_not_ready"

    @property
    def mtp_enabled(self) -> bool | None:
        """The contract's gate for each state, as the precedence table states it."""
        if self.boot is None:
            return None
        pin = self.settings.pin
        if self.reason in ("no_mtp_dispatch", "sharded"):
            return False
        if self.reason == "adaptive_disabled":
            return self.boot.host.static_mtp_gate if pin is None else pin
        if self.state == "forced":
            return pin
        if self.state == "settled":
            return self.verdict is not None and self.verdict[0] == "enable"
        return self.state == "profiling"  # and exactness_declined: off

    def check(self, policy: MtpPolicy) -> None:
        """The policy's live gate and published body agree with this reference."""
        body = policy.snapshot.to_wire()
        assert (body["state"], body["reason"], body["mtp_enabled"]) == (self.state, self.reason, self.mtp_enabled)
        assert policy.mtp_enabled == self.mtp_enabled  # the gate the worker consults
        verdict, samples = self.verdict or (None, len(self.window))
        assert (body["verdict"], body["samples"]) == (verdict, samples)


def check_invariants(snap: MtpPolicySnapshot) -> None:
    body: dict[str, Any] = snap.to_wire()
    validate_wire(body)
    assert list(body)[:17] == [
        "schema_version", "state", "reason", "decline_detail", "verdict", "mtp_enabled", "target",
        "drafter", "hardware", "gpu_vendor", "gpu_device", "gpu_architecture", "block_size",
        "acceptance_rate", "samples", "samples_required", "samples_remaining"]
    state = body["state"]
    assert (body["reason"] is not None) == (state == "unavailable")
    assert (body["decline_detail"] is not None) == (state == "exactness_declined")
    assert (body["verdict"] is not None) == (state == "settled")
    assert (body["samples_remaining"] is not None) == (state == "profiling")
    assert (body["mtp_enabled"] is None) == (body["reason"] == "worker_not_ready")
    assert 0 <= body["samples"] <= body["samples_required"]
    if state == "profiling":
        assert body["samples"] + body["samples_remaining"] == body["samples_required"]
        assert body["mtp_enabled"] is True
    if state == "settled":
        assert body["acceptance_rate"] == round(body["acceptance_rate"], 2)
        assert body["mtp_enabled"] == (body["verdict"] == "enable")
    if state in ("forced", "unavailable", "exactness_declined"):
        assert body["samples"] == 0 and body["acceptance_rate"] is None
    health = snap.to_health()
    assert health["status"] == state and "schema_version" not in health
    assert "samples_remaining" not in health and "state" not in health
    assert {k: v for k, v in body.items() if k not in ("schema_version", "state", "samples_remaining")} == {
        k: v for k, v in health.items() if k != "status"}


def run_sequence(settings_: PolicySettings, sequence: list[tuple[str, Any]]) -> None:
    """Drive a policy and the reference with the same events; check the body after each."""
    with tempfile.TemporaryDirectory() as cache:
        published: list[MtpPolicySnapshot] = []
        policy = MtpPolicy(settings_, HintStore(Path(cache)), publish=published.append)
        reference = Reference(settings_)
        check_invariants(policy.snapshot)
        reference.check(policy)
        for kind, data in sequence:
            if kind == "ready":
                if policy.snapshot.reason != "worker_not_ready":
                    # A second ready is refused before anything changes (D14).
                    before, count = policy.snapshot, len(published)
                    with pytest.raises(RuntimeError, match="already ready"):
                        policy.on_worker_ready(data)
                    assert policy.snapshot is before and len(published) == count
                    reference.check(policy)
                    policy.on_worker_lost()
                    reference.lost()
                policy.on_worker_ready(data)
                reference.ready(data)
            elif kind == "sample":
                policy.on_sample(data)
                reference.sample(data)
            else:
                policy.on_worker_lost()
                reference.lost()
            check_invariants(policy.snapshot)
            reference.check(policy)
            if published:
                assert published[-1] is policy.snapshot


@settings(max_examples=150, deadline=None)
@given(policy_settings, events)
def test_any_event_sequence_follows_the_reference_and_the_body_rules(
        settings_: PolicySettings, sequence: list[tuple[str, Any]]) -> None:
    run_sequence(settings_, sequence)


@settings(max_examples=100, deadline=None)
@given(measuring_settings, measuring_events)
def test_profiling_windows_settle_and_restore_as_the_reference_says(
        settings_: PolicySettings, sequence: list[tuple[str, Any]]) -> None:
    run_sequence(settings_, sequence)
