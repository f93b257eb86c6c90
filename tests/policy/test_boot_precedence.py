"""Boot resolution: every row of the precedence table, and every combination that matters."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from mlxcel.policy import BootFacts, Hint, HintStore, HostInfo, MtpPolicy, PairingKey, PolicySettings
from tests.conftest import APPLE_M5, LINUX_CPU, validate_wire

DETAIL = "verify block position 0 differs from the single-token chain in 3 of 4096 logit bytes."


def _key(host: HostInfo) -> PairingKey:
    return PairingKey(target="qwen-tiny", drafter="qwen-tiny-mtp", hardware=host.label, block_size=4)


def _boot(cache: Path, *, settings: PolicySettings, host: HostInfo = LINUX_CPU, has_pairing: bool = True,
          probe: str | None = None, stored: str | None = None, sharded: bool = False) -> MtpPolicy:
    store = HintStore(cache)
    if stored is not None:
        store.save(Hint(key=_key(host), verdict=stored, acceptance_rate=0.7, samples=4,  # type: ignore[arg-type]
                        estimated_speedup=1.8))
    policy = MtpPolicy(settings, store)
    policy.on_worker_ready(BootFacts(host=host, pairing=_key(host) if has_pairing else None,
                                     probe_decline=probe, sharded=sharded))
    validate_wire(policy.snapshot.to_wire())
    return policy


def test_row1_no_mtp_dispatch_beats_everything(tmp_path: Path) -> None:
    policy = _boot(tmp_path, settings=PolicySettings(adaptive=False, pin=True), has_pairing=False,
                   probe=DETAIL, stored="enable")
    body = policy.snapshot.to_wire()
    assert (body["state"], body["reason"], body["mtp_enabled"]) == ("unavailable", "no_mtp_dispatch", False)
    assert body["target"] is body["drafter"] is body["hardware"] is body["block_size"] is None
    assert body["samples"] == 0 and body["samples_remaining"] is None


def test_row2_sharded_model_is_unavailable_whatever_else_holds(tmp_path: Path) -> None:
    policy = _boot(tmp_path, settings=PolicySettings(adaptive=False, pin=True), sharded=True,
                   probe=DETAIL, stored="enable")
    body = policy.snapshot.to_wire()
    assert (body["state"], body["reason"], body["mtp_enabled"]) == ("unavailable", "sharded", False)
    # The pairing is still named, so a consumer sees what is configured and where.
    assert (body["target"], body["hardware"], body["block_size"]) == ("qwen-tiny", LINUX_CPU.label, 4)
    assert body["verdict"] is None and body["samples"] == 0 and body["decline_detail"] is None
    assert policy.mtp_enabled is False


def test_row1_without_a_drafter_a_sharded_model_has_no_mtp_dispatch(tmp_path: Path) -> None:
    policy = _boot(tmp_path, settings=PolicySettings(), has_pairing=False, sharded=True)
    assert (policy.snapshot.state, policy.snapshot.reason) == ("unavailable", "no_mtp_dispatch")


@pytest.mark.parametrize(("pin", "host", "enabled"), [
    (None, LINUX_CPU, False), (None, APPLE_M5, True), (True, LINUX_CPU, True), (False, APPLE_M5, False),
])
def test_row2_adaptive_disabled_reports_pin_or_static_gate(tmp_path: Path, pin: bool | None,
                                                           host: HostInfo, enabled: bool) -> None:
    policy = _boot(tmp_path, settings=PolicySettings(adaptive=False, pin=pin), host=host,
                   probe=DETAIL, stored="decline")
    body = policy.snapshot.to_wire()
    assert (body["state"], body["reason"], body["mtp_enabled"]) == (
        "unavailable", "adaptive_disabled", enabled)
    assert body["target"] == "qwen-tiny" and body["block_size"] == 4
    assert body["verdict"] is None and body["acceptance_rate"] is None and body["samples"] == 0


@pytest.mark.parametrize("pin", [True, False])
def test_row3_pin_forces_without_measuring(tmp_path: Path, pin: bool) -> None:
    policy = _boot(tmp_path, settings=PolicySettings(pin=pin), probe=DETAIL, stored="enable")
    body = policy.snapshot.to_wire()
    assert (body["state"], body["reason"], body["mtp_enabled"]) == ("forced", None, pin)
    assert body["verdict"] is None and body["acceptance_rate"] is None and body["samples"] == 0


def test_row4_probe_veto(tmp_path: Path) -> None:
    policy = _boot(tmp_path, settings=PolicySettings(), probe=DETAIL, stored="enable")
    body = policy.snapshot.to_wire()
    assert (body["state"], body["mtp_enabled"], body["decline_detail"]) == (
        "exactness_declined", False, DETAIL)
    assert body["verdict"] is None and body["samples"] == 0 and body["samples_remaining"] is None


def test_row4_allow_inexact_runs_past_the_veto(tmp_path: Path) -> None:
    policy = _boot(tmp_path, settings=PolicySettings(allow_inexact=True), probe=DETAIL)
    body = policy.snapshot.to_wire()
    assert body["state"] == "profiling" and body["decline_detail"] is None


@pytest.mark.parametrize("verdict", ["enable", "decline"])
def test_row5_restores_a_valid_hint(tmp_path: Path, verdict: str) -> None:
    policy = _boot(tmp_path, settings=PolicySettings(), stored=verdict)
    body = policy.snapshot.to_wire()
    assert (body["state"], body["verdict"], body["mtp_enabled"]) == ("settled", verdict, verdict == "enable")
    assert (body["acceptance_rate"], body["samples"], body["estimated_speedup"]) == (0.7, 4, 1.8)


def test_row6_otherwise_profiles(tmp_path: Path) -> None:
    policy = _boot(tmp_path, settings=PolicySettings())
    body = policy.snapshot.to_wire()
    assert (body["state"], body["mtp_enabled"], body["samples"], body["samples_remaining"]) == (
        "profiling", True, 0, 4)
    assert body["acceptance_rate"] is None


def _expected(has_pairing: bool, adaptive: bool, pin: bool | None, allow_inexact: bool,
              probe: str | None, stored: str | None, host: HostInfo,
              sharded: bool = False) -> tuple[str, str | None, bool]:
    """The precedence table of the architecture doc, written out as plainly as possible."""
    if not has_pairing:
        return "unavailable", "no_mtp_dispatch", False
    if sharded:
        return "unavailable", "sharded", False
    if not adaptive:
        return "unavailable", "adaptive_disabled", pin if pin is not None else host.static_mtp_gate
    if pin is not None:
        return "forced", None, pin
    if probe is not None and not allow_inexact:
        return "exactness_declined", None, False
    if stored is not None:
        return "settled", None, stored == "enable"
    return "profiling", None, True


COMBINATIONS = list(itertools.product(
    [True, False], [True, False], [None, True, False], [True, False], [None, DETAIL],
    [None, "enable", "decline"], [LINUX_CPU, APPLE_M5], [False, True]))


@pytest.mark.parametrize(("has_pairing", "adaptive", "pin", "allow_inexact", "probe", "stored", "host", "sharded"),
                         COMBINATIONS)
def test_every_combination_follows_the_table(tmp_path: Path, has_pairing: bool, adaptive: bool,
                                             pin: bool | None, allow_inexact: bool, probe: str | None,
                                             stored: str | None, host: HostInfo, sharded: bool) -> None:
    settings = PolicySettings(adaptive=adaptive, pin=pin, allow_inexact=allow_inexact)
    policy = _boot(tmp_path, settings=settings, host=host, has_pairing=has_pairing, probe=probe,
                   stored=stored, sharded=sharded)
    expected = _expected(has_pairing, adaptive, pin, allow_inexact, probe, stored, host, sharded)
    snap = policy.snapshot
    assert (snap.state, snap.reason, snap.mtp_enabled) == expected
    assert policy.mtp_enabled == expected[2]  # the live gate the worker consults, against the table too
