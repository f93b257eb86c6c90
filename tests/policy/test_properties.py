"""Any sequence of events keeps the published body within the contract's rules."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

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
from tests.conftest import APPLE_M5, LINUX_CPU, validate_wire

keys = st.builds(PairingKey, target=st.sampled_from(["a", "b"]), drafter=st.just("a-mtp"),
                 hardware=st.sampled_from([APPLE_M5.label, LINUX_CPU.label]),
                 block_size=st.integers(2, 5))
boots = st.builds(BootFacts, host=st.sampled_from([APPLE_M5, LINUX_CPU]), pairing=st.none() | keys,
                  probe_decline=st.none() | st.just("verify block position 0 differs"))


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


def check_invariants(snap: MtpPolicySnapshot, live_gate: bool | None) -> None:
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
    assert body["mtp_enabled"] == live_gate
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


@settings(max_examples=150, deadline=None)
@given(policy_settings, events)
def test_any_event_sequence_keeps_the_body_invariants(
        settings_: PolicySettings, sequence: list[tuple[str, Any]]) -> None:
    with tempfile.TemporaryDirectory() as cache:
        published: list[MtpPolicySnapshot] = []
        policy = MtpPolicy(settings_, HintStore(Path(cache)), publish=published.append)
        check_invariants(policy.snapshot, policy.mtp_enabled)
        for kind, data in sequence:
            if kind == "ready":
                if policy.snapshot.reason != "worker_not_ready":
                    policy.on_worker_lost()
                policy.on_worker_ready(data)
            elif kind == "sample":
                policy.on_sample(data)
            else:
                policy.on_worker_lost()
            check_invariants(policy.snapshot, policy.mtp_enabled)
            if published:
                assert published[-1] is policy.snapshot
