"""The contract's example bodies, reproduced field for field (plus our added fields)."""

from __future__ import annotations

from pathlib import Path

from mlxcel.policy import BootFacts, BurstSample, HintStore, HostInfo, MtpPolicy, PairingKey, PolicySettings
from tests.conftest import APPLE_M5, validate_wire

GEMMA = PairingKey(target="Gemma4-12B", drafter="Gemma4-12B-MTP", hardware="M5-16c", block_size=4)
GPU_FIELDS = {"gpu_vendor": "Apple", "gpu_device": "Apple M5", "gpu_architecture": "applegpu_g17p"}


def _burst(accepted: int, proposed: int) -> BurstSample:
    return BurstSample(rounds=10, proposed=proposed, accepted=accepted, round_seconds=0.2,
                       classic_steps=3, classic_seconds=0.03)


def test_settled_example(tmp_path: Path) -> None:
    policy = MtpPolicy(PolicySettings(), HintStore(tmp_path))
    policy.on_worker_ready(BootFacts(host=APPLE_M5, pairing=GEMMA))
    for accepted in (15, 16, 15, 16):  # 62 of 100 proposed
        policy.on_sample(_burst(accepted, 25))
    body = policy.snapshot.to_wire()
    validate_wire(body)
    assert body == {
        "schema_version": 1,
        "state": "settled",
        "reason": None,
        "decline_detail": None,
        "verdict": "enable",
        "mtp_enabled": True,
        "target": "Gemma4-12B",
        "drafter": "Gemma4-12B-MTP",
        "hardware": "M5-16c",
        **GPU_FIELDS,
        "block_size": 4,
        "acceptance_rate": 0.62,
        "samples": 4,
        "samples_required": 4,
        "samples_remaining": None,
        # (62/40 + 1) x 10 ms / 20 ms = 1.275: the ambiguous zone, where the static gate (on for M5) decides.
        "estimated_speedup": 1.27,
        "depth_limit": None,  # mlxcel's addition, as estimated_speedup
        "batch": None,  # mlxcel's addition too: the policy alone publishes no batch
    }


def test_profiling_example(tmp_path: Path) -> None:
    policy = MtpPolicy(PolicySettings(), HintStore(tmp_path))
    policy.on_worker_ready(BootFacts(host=APPLE_M5, pairing=GEMMA))
    policy.on_sample(_burst(29, 50))
    policy.on_sample(_burst(29, 50))
    body = policy.snapshot.to_wire()
    validate_wire(body)
    assert {k: v for k, v in body.items() if k != "estimated_speedup"} == {
        "schema_version": 1,
        "state": "profiling",
        "reason": None,
        "decline_detail": None,
        "verdict": None,
        "mtp_enabled": True,
        "target": "Gemma4-12B",
        "drafter": "Gemma4-12B-MTP",
        "hardware": "M5-16c",
        **GPU_FIELDS,
        "block_size": 4,
        "acceptance_rate": 0.58,
        "samples": 2,
        "samples_required": 4,
        "samples_remaining": 2,
        "depth_limit": None,
        "batch": None,
    }


def test_no_drafter_example() -> None:
    policy = MtpPolicy(PolicySettings(), None)
    policy.on_worker_ready(BootFacts(host=APPLE_M5, pairing=None))
    body = policy.snapshot.to_wire()
    validate_wire(body)
    assert body == {
        "schema_version": 1,
        "state": "unavailable",
        "reason": "no_mtp_dispatch",
        "decline_detail": None,
        "verdict": None,
        "mtp_enabled": False,
        "target": None,
        "drafter": None,
        "hardware": None,
        **GPU_FIELDS,
        "block_size": None,
        "acceptance_rate": None,
        "samples": 0,
        "samples_required": 4,
        "samples_remaining": None,
        "estimated_speedup": None,
        "depth_limit": None,  # mlxcel's addition, as estimated_speedup
        "batch": None,  # mlxcel's addition too: the policy alone publishes no batch
    }


def test_exactness_declined_example(tmp_path: Path) -> None:
    detail = ("verify block position 0 differs from the single-token chain in 245722 of 524288 logit "
              "bytes. Disabling qmv_wide did not make it exact either.")
    host = HostInfo(label="M5-40c", gpu_vendor="Apple", gpu_device="Apple M5 Max",
                    gpu_architecture="applegpu_g17d", static_mtp_gate=True)
    key = PairingKey(target="gemma-4-31b-it-4bit", drafter="gemma-4-31b-it-assistant-bf16",
                     hardware="M5-40c", block_size=4)
    policy = MtpPolicy(PolicySettings(), HintStore(tmp_path))
    policy.on_worker_ready(BootFacts(host=host, pairing=key, probe_decline=detail))
    body = policy.snapshot.to_wire()
    validate_wire(body)
    assert body == {
        "schema_version": 1,
        "state": "exactness_declined",
        "reason": None,
        "decline_detail": detail,
        "verdict": None,
        "mtp_enabled": False,
        "target": "gemma-4-31b-it-4bit",
        "drafter": "gemma-4-31b-it-assistant-bf16",
        "hardware": "M5-40c",
        "gpu_vendor": "Apple",
        "gpu_device": "Apple M5 Max",
        "gpu_architecture": "applegpu_g17d",
        "block_size": 4,
        "acceptance_rate": None,
        "samples": 0,
        "samples_required": 4,
        "samples_remaining": None,
        "estimated_speedup": None,
        "depth_limit": None,  # mlxcel's addition, as estimated_speedup
        "batch": None,  # mlxcel's addition too: the policy alone publishes no batch
    }
