"""A simulated machine for :class:`~mlxcel.policy.draft_length.DraftLength`: known step costs and acceptance."""

from __future__ import annotations

import random
from collections.abc import Callable

from mlxcel.policy.draft_length import DraftLength

Cost = Callable[[int, int, int], float]  # (width, depth, K) -> seconds of a step


def linear_cost(classic: float, per_draft: float, depth_cost: float = 0.0) -> Cost:
    """A step's cost: the classic step's, plus *per_draft* per draft per row, plus a depth term that a verify
    pays once per verified position (its attention) and a classic step once."""
    def cost(width: int, depth: int, k: int) -> float:
        return classic * width ** 0.5 + per_draft * width * k + depth_cost * depth * (k + 1)
    return cost


def run(rule: DraftLength, cost: Cost, acceptance: Callable[[int], float], steps: int, width: int = 4,
        depth: int = 100, seed: int = 0, shared: bool = False, step_up: float = 0.0) -> tuple[float, list[int]]:
    """Drive *rule* for *steps* steps; (tokens per second over the run, the K chosen at each step). *shared*: the
    rows share one text, so each step's drafts are kept or rejected in every row alike. *step_up*: the share a step at
    more drafts than the step before it costs on top (one-off costs: reported not timed, as the engine does)."""
    rng = random.Random(seed)
    tokens, seconds, chosen = 0, 0.0, []
    for step in range(steps):
        k = rule.choose(width, depth)
        up = k > (chosen[-1] if chosen else 0)
        chosen.append(k)
        took = cost(width, depth, k) * (1 + step_up * up)
        if k == 0:
            rule.classic(width, depth, took)
            tokens += width
        else:
            kept = []
            for _ in range(1 if shared else width):
                count = 0
                while count < k and rng.random() < acceptance(step):
                    count += 1
                kept.append(count)
            kept *= width // len(kept)
            rule.speculative(width, depth, k, took, kept, timed=not up)
            tokens += width + sum(kept)
        seconds += took
    return tokens / seconds, chosen


def classic_rate(cost: Cost, width: int = 4, depth: int = 100) -> float:
    return width / cost(width, depth, 0)


def best_fixed_rate(cost: Cost, alpha: float, max_k: int, width: int = 4, depth: int = 100) -> float:
    def expected(k: int) -> float:
        return sum(alpha ** j for j in range(k + 1))
    return max(width * expected(k) / cost(width, depth, k) for k in range(max_k + 1))


def sixteen_rows_at_2k(width: int, depth: int, k: int) -> float:
    """A step's seconds at 16 rows over 2k keys of the released shapes (docs/benchmarks.md, 2026-12-05, sixth)."""
    return (0.442, 0.81, 1.10, 1.45)[k]
