"""Building blocks for policy tests: samples with a chosen acceptance and speedup."""

from __future__ import annotations

from mlxcel.policy import BurstSample


def sample(accepted: int = 2, proposed: int = 3, rounds: int = 1, speedup: float = 2.0) -> BurstSample:
    """A burst whose estimated speedup alone is *speedup*.

    Classic step = 10 ms; the round time is chosen so that
    (accepted/rounds + 1) x classic / round = speedup.
    """
    classic = 0.010
    tokens_per_round = accepted / rounds + 1
    round_seconds = tokens_per_round * classic / speedup
    return BurstSample(rounds=rounds, proposed=proposed, accepted=accepted,
                       round_seconds=round_seconds * rounds, classic_steps=3, classic_seconds=3 * classic)


def deep_sample(depth: int, accepted: int = 3, rounds: int = 2, slowdown: float = 1.0) -> BurstSample:
    """A burst at *depth* tokens of context on a machine where a classic step costs 10 ms + 1 us a
    token of context and a round 15 ms + 3.5 us a token (a verify attends once per position it checks);
    *slowdown* scales the round time (a first burst's compile cost)."""
    step = 0.010 + 1e-6 * depth
    round_time = (0.015 + 3.5e-6 * depth) * slowdown
    return BurstSample(rounds=rounds, proposed=2 * rounds, accepted=accepted, round_seconds=round_time * rounds,
                       classic_steps=3, classic_seconds=3 * step, depth=depth)
