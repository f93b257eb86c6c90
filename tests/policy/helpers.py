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
