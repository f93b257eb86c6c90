"""The consumer renderer follows the contract's consumer rules on every state."""

from __future__ import annotations

from typing import Any

import pytest

from mlxcel.client import NO_VERDICT, render
from mlxcel.policy import BootFacts, MtpPolicy, PairingKey, PolicySettings
from tests.conftest import APPLE_M5
from tests.policy.helpers import deep_sample, sample

KEY = PairingKey("Gemma4-12B", "Gemma4-12B-MTP", "M5-16c", 4)
DEFAULTS = PolicySettings()


def _body(settings: PolicySettings = DEFAULTS, pairing: PairingKey | None = KEY,
          probe: str | None = None, samples: int = 0) -> dict[str, Any]:
    policy = MtpPolicy(settings)
    policy.on_worker_ready(BootFacts(host=APPLE_M5, pairing=pairing, probe_decline=probe))
    for _ in range(samples):
        policy.on_sample(sample(accepted=29, proposed=50))
    return policy.snapshot.to_wire()


def test_profiling() -> None:
    assert render(_body(samples=2)) == (
        "measuring: 2 of 4 single-request generations done (acceptance 0.58 so far)\n"
        "pairing: Gemma4-12B + Gemma4-12B-MTP on M5-16c, K=4")


def test_settled() -> None:
    text = render(_body(samples=4))
    assert text is not None
    assert text.splitlines()[0] == "MTP enabled: measured on this machine (acceptance 0.58 over 4 samples)"


def test_a_depth_limit_is_shown_with_an_enable_verdict() -> None:
    policy = MtpPolicy(DEFAULTS)
    policy.on_worker_ready(BootFacts(host=APPLE_M5, pairing=KEY))
    for depth in (100, 2_000, 4_000, 6_000):
        policy.on_sample(deep_sample(depth))
    body = policy.snapshot.to_wire()
    limit = body["depth_limit"]
    assert isinstance(limit, int)
    text = render(body)
    assert text is not None
    assert text.splitlines()[1] == (f"single requests from {limit} tokens of context start classic (the burst is "
                                    "estimated to stop paying there; the rule of K measures it again)")
    assert str(limit) not in (render({**body, "verdict": "decline"}) or "")


def test_pin_renders_as_a_pin_not_a_measurement() -> None:
    for pin in (True, False):
        text = render(_body(PolicySettings(pin=pin)))
        assert text is not None
        assert text.startswith(f"MTP pinned {'on' if pin else 'off'} by the operator")
        assert "measured on" not in text


def test_exactness_declined_shows_the_detail_verbatim() -> None:
    detail = "verify block position 0 differs from the single-token chain in 5 of 8 logit bytes."
    assert render(_body(probe=detail)) == (
        "MTP configured but vetoed; running classic decode\n"
        f"reason: {detail}\n"
        "pairing: Gemma4-12B + Gemma4-12B-MTP on M5-16c, K=4")


@pytest.mark.parametrize(("settings", "pairing", "expected"), [
    (PolicySettings(), None, "MTP not available: this server has no MTP drafter"),
    (PolicySettings(adaptive=False), KEY, "adaptive MTP policy disabled (MLXCEL_MTP_ADAPTIVE); "
                                          "nothing measured; MTP is on by pin or static default"),
])
def test_unavailable(settings: PolicySettings, pairing: PairingKey | None, expected: str) -> None:
    text = render(_body(settings, pairing))
    assert text is not None and text.splitlines()[0] == expected


def test_worker_not_ready() -> None:
    assert render(MtpPolicy(PolicySettings()).snapshot.to_wire()) == (
        "MTP policy not known yet: the model is still loading")


@pytest.mark.parametrize("change", [
    {"state": "hibernating"},
    {"state": "settled", "verdict": "partially"},
    {"state": "unavailable", "reason": "moon_phase"},
    {"state": "profiling", "samples": "two"},
    {"state": 7},
])
def test_unknown_labels_are_no_verdict_never_an_error(change: dict[str, Any]) -> None:
    assert render({**_body(samples=4), **change}) == NO_VERDICT


def test_unknown_fields_are_ignored() -> None:
    body = _body(samples=2)
    assert render({**body, "future_field": {"nested": [1, 2]}, "tokens_per_joule": 3.5}) == render(body)


@pytest.mark.parametrize("version", [2, 0, "1", None, True, 1.5])
def test_unknown_schema_version_renders_nothing(version: Any) -> None:
    assert render({**_body(samples=4), "schema_version": version}) is None


@pytest.mark.parametrize("body", [None, [], "settled", 1])
def test_non_object_bodies_render_nothing(body: Any) -> None:
    assert render(body) is None


def test_the_rule_of_k_is_a_line_alone_and_a_line_in_the_batch() -> None:
    from mlxcel.policy.batch_view import BatchCell, BatchView
    from tests.conftest import validate_wire

    policy = MtpPolicy(DEFAULTS)
    policy.on_worker_ready(BootFacts(host=APPLE_M5, pairing=KEY, probe_decline=None))
    policy.on_batch(BatchView(True, None, (BatchCell(2, 0, 1023, 3, 1.52), BatchCell(8, 0, 1023, 0, 1.0),
                                           BatchCell(2, 1024, 2047, 1, None))))
    body = policy.snapshot.to_wire()
    validate_wire(body)
    assert render(body) == (
        "measuring: 0 of 4 single-request generations done (acceptance not measured so far)\n"
        "pairing: Gemma4-12B + Gemma4-12B-MTP on M5-16c, K=4\n"
        "in the batch: 2 at once, 0-1023 tokens: K=3, 1.52x; 8 at once, 0-1023 tokens: classic; "
        "2 at once, 1024-2047 tokens: K=1")
    policy.on_batch(BatchView(True, None, (BatchCell(2, 0, 1023, 3, 1.52),), ((5, "a 5 x 4 verify differs"),)))
    validate_wire(policy.snapshot.to_wire())
    assert render(policy.snapshot.to_wire()).splitlines()[-1] == (  # type: ignore[union-attr]
        "in the batch: 2 at once, 0-1023 tokens: K=3, 1.52x (classic, not exact here: 5 at once)")
    policy.on_batch(BatchView(False, "MTP is pinned off (MLXCEL_ENABLE_MTP_B1)"))
    validate_wire(policy.snapshot.to_wire())
    assert render(policy.snapshot.to_wire()).splitlines()[-1] == (  # type: ignore[union-attr]
        "in the batch: classic decode (MTP is pinned off (MLXCEL_ENABLE_MTP_B1))")
    # A lone request's rounds (width 1) are the same rule's: a line of their own, before the batch's.
    policy.on_batch(BatchView(False, "its drafter cannot draft for a batch's rows at once",
                              (BatchCell(1, 0, 1023, 3, 2.1), BatchCell(1, 4096, 8191, 0, 1.0))))
    validate_wire(policy.snapshot.to_wire())
    assert render(policy.snapshot.to_wire()).splitlines()[-2:] == [  # type: ignore[union-attr]
        "alone, round by round: 0-1023 tokens: K=3, 2.10x; 4096-8191 tokens: classic",
        "in the batch: classic decode (its drafter cannot draft for a batch's rows at once)"]
    policy.on_worker_lost()
    assert policy.snapshot.to_wire()["batch"] is None
