"""The speedup estimate and the decision zones."""

from __future__ import annotations

import pytest

from mlxcel.policy import DECLINE_AT_OR_BELOW, ENABLE_AT_OR_ABOVE, BurstSample
from mlxcel.policy.estimator import acceptance_rate, decide, estimate_speedup
from tests.policy.helpers import sample


@pytest.mark.parametrize(("speedup", "gate", "verdict"), [
    (DECLINE_AT_OR_BELOW, True, "decline"),
    (0.5, True, "decline"),
    (ENABLE_AT_OR_ABOVE, False, "enable"),
    (3.0, False, "enable"),
    (1.05, True, "enable"),
    (1.05, False, "decline"),
    (None, True, "enable"),
    (None, False, "decline"),
])
def test_decision_zones(speedup: float | None, gate: bool, verdict: str) -> None:
    assert decide(speedup, gate) == verdict


def test_speedup_formula() -> None:
    # 6 accepted over 3 rounds: 3 tokens a round; 10 ms classic, 20 ms a round: 1.5x.
    s = BurstSample(rounds=3, proposed=9, accepted=6, round_seconds=0.060, classic_steps=2,
                    classic_seconds=0.020)
    assert estimate_speedup([s]) == pytest.approx(1.5)


def test_first_burst_compile_cost_does_not_swing_the_estimate() -> None:
    steady = [sample(speedup=2.0) for _ in range(3)]
    compile_heavy = BurstSample(rounds=1, proposed=3, accepted=2, round_seconds=5.0,
                                classic_steps=3, classic_seconds=0.03)
    assert estimate_speedup([compile_heavy, *steady]) == pytest.approx(2.0)


def test_no_classic_probe_means_no_estimate() -> None:
    assert estimate_speedup([BurstSample(rounds=1, proposed=3, accepted=1, round_seconds=0.1)]) is None
    assert estimate_speedup([]) is None


def test_acceptance_is_pooled() -> None:
    assert acceptance_rate([sample(accepted=1, proposed=4), sample(accepted=3, proposed=4)]) == 0.5
    assert acceptance_rate([]) is None


@pytest.mark.parametrize("bad", [
    {"rounds": 0}, {"accepted": 5, "proposed": 3}, {"accepted": -1}, {"proposed": 0, "accepted": 0},
    {"round_seconds": -1.0}, {"round_seconds": float("nan")}, {"classic_steps": -1},
])
def test_malformed_samples_are_rejected(bad: dict[str, float]) -> None:
    fields = {"rounds": 1, "proposed": 3, "accepted": 1, "round_seconds": 0.1, **bad}
    with pytest.raises(ValueError):
        BurstSample(**fields)  # type: ignore[arg-type]
