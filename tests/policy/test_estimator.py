"""The speedup estimate and the decision zones."""

from __future__ import annotations

import pytest

from mlxcel.policy import DECLINE_AT_OR_BELOW, ENABLE_AT_OR_ABOVE, BurstSample
from mlxcel.policy.estimator import MIN_DEPTH_SPREAD, acceptance_rate, decide, estimate_depth_limit, estimate_speedup
from tests.policy.helpers import deep_sample, sample


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


def test_a_round_is_never_counted_cheaper_than_a_classic_step() -> None:
    # A head that never agrees, its classic steps timed in a spell of load (12 ms, its rounds 10 ms): the clock
    # says 1.2x, above the enable line; a round runs the target and the head, so it cannot cost less than a step.
    never = [BurstSample(rounds=4, proposed=8, accepted=0, round_seconds=0.040, classic_steps=3,
                         classic_seconds=0.036) for _ in range(4)]
    assert estimate_speedup(never) == pytest.approx(1.0)
    assert decide(estimate_speedup(never), static_gate=True) == "decline"
    # The same clock with drafts kept half the time: the tokens a round yields, no more.
    half = [BurstSample(rounds=4, proposed=8, accepted=4, round_seconds=0.040, classic_steps=3,
                        classic_seconds=0.036) for _ in range(4)]
    assert estimate_speedup(half) == pytest.approx(2.0)
    # The depth limit's estimate at the shallowest sample is bounded alike: rounds that grow faster with depth
    # than the steps they replace, the shallowest round timed below its step.
    deep = [BurstSample(rounds=2, proposed=4, accepted=0, round_seconds=2 * (0.010 + 3e-6 * d), classic_steps=1,
                        classic_seconds=0.012 + 1e-6 * d, depth=d) for d in (0, 2_000, 4_000, 6_000)]
    limit = estimate_depth_limit(deep)
    assert limit is not None and limit.shallow_speedup == pytest.approx(1.0)


def test_first_burst_compile_cost_does_not_swing_the_estimate() -> None:
    steady = [sample(speedup=2.0) for _ in range(3)]
    compile_heavy = BurstSample(rounds=1, proposed=3, accepted=2, round_seconds=5.0,
                                classic_steps=3, classic_seconds=0.03)
    assert estimate_speedup([compile_heavy, *steady]) == pytest.approx(2.0)


def test_no_classic_probe_means_no_estimate() -> None:
    assert estimate_speedup([BurstSample(rounds=1, proposed=3, accepted=1, round_seconds=0.1)]) is None
    assert estimate_speedup([]) is None


def test_times_too_small_for_their_ratio_to_be_a_float_give_no_estimate() -> None:
    # 1.0 / 2.2e-311 overflows to infinity: a verdict from it would be persisted as "Infinity", which no
    # JSON reader (the hint store's included) takes for a number, and so not restored (found by the
    # policy's property test).
    tiny = BurstSample(rounds=1, proposed=1, accepted=0, round_seconds=2.225073858507e-311, classic_steps=1,
                       classic_seconds=1.0)
    assert estimate_speedup([tiny]) is None
    tiny_at_depth = [BurstSample(rounds=1, proposed=1, accepted=1, round_seconds=5e-324 * (1 + d), classic_steps=1,
                                 classic_seconds=1.0, depth=d) for d in (0, 4096, 8192)]
    assert estimate_depth_limit(tiny_at_depth) is None


def test_acceptance_is_pooled() -> None:
    assert acceptance_rate([sample(accepted=1, proposed=4), sample(accepted=3, proposed=4)]) == 0.5
    assert acceptance_rate([]) is None


@pytest.mark.parametrize("bad", [
    {"rounds": 0}, {"accepted": 5, "proposed": 3}, {"accepted": -1}, {"proposed": 0, "accepted": 0},
    {"round_seconds": -1.0}, {"round_seconds": float("nan")}, {"classic_steps": -1}, {"depth": -1},
])
def test_malformed_samples_are_rejected(bad: dict[str, float]) -> None:
    fields = {"rounds": 1, "proposed": 3, "accepted": 1, "round_seconds": 0.1, **bad}
    with pytest.raises(ValueError):
        BurstSample(**fields)  # type: ignore[arg-type]


# deep_sample's machine: 2.5 tokens a round (3 of 4 drafts accepted over 2 rounds); the burst pays
# while 2.5 x (10 ms + 1 us d) > 15 ms + 3.5 us d, that is below d = (25 - 15) ms / (3.5 - 2.5) us = 10,000.
CROSSING = 10_000


def test_the_depth_limit_is_where_the_burst_stops_paying() -> None:
    samples = [deep_sample(d) for d in (100, 2_000, 4_000, 6_000)]
    limit = estimate_depth_limit(samples)
    assert limit is not None and limit.depth == pytest.approx(CROSSING, abs=1)
    # At the shallowest sample: 2.5 x 10.1 ms / 15.35 ms.
    assert limit.shallow_speedup == pytest.approx(2.5 * 10.1 / 15.35)
    # Checked against the speedup estimate of samples measured there and either side of it.
    assert estimate_speedup([deep_sample(CROSSING)]) == pytest.approx(1.0)
    assert estimate_speedup([deep_sample(CROSSING - 1_000)]) > 1.0 > estimate_speedup([deep_sample(CROSSING + 1_000)])


def test_a_first_burst_s_compile_cost_does_not_move_the_depth_limit_much() -> None:
    samples = [deep_sample(100, slowdown=5.0), *(deep_sample(d) for d in (2_000, 4_000, 6_000))]
    limit = estimate_depth_limit(samples)
    assert limit is not None and limit.depth == pytest.approx(CROSSING, rel=0.1)


def test_no_depth_limit_without_samples_far_enough_apart() -> None:
    close = [deep_sample(d) for d in (3_000, 3_000 + MIN_DEPTH_SPREAD - 1)]
    assert estimate_depth_limit(close) is None
    assert estimate_depth_limit([deep_sample(5_000)]) is None
    assert estimate_depth_limit([]) is None


def test_no_depth_limit_when_rounds_grow_no_faster_than_the_steps_they_replace() -> None:
    # Classic steps and rounds both 2x as slow at 8k: the ratio, and so the speedup, holds at any depth.
    flat = [BurstSample(rounds=1, proposed=2, accepted=2, round_seconds=0.02 * (1 + d / 8192),
                        classic_steps=2, classic_seconds=0.02 * (1 + d / 8192), depth=d) for d in (0, 4096, 8192)]
    assert estimate_depth_limit(flat) is None


def test_no_depth_limit_below_the_shallowest_sample() -> None:
    # Losing already at the shallowest sample: the window's own estimate, and so the verdict, decides.
    deep = [deep_sample(d) for d in (12_000, 14_000, 16_000)]
    assert estimate_depth_limit(deep) is None
