"""The persisted step-cost table: a restart trusts what was measured, and a bad table is refused whole."""

from __future__ import annotations

import json

from mlxcel.policy.cost_table import depth_band
from mlxcel.policy.draft_length import DraftLength

from .simulated import linear_cost, run


def test_the_step_costs_round_trip_and_a_bad_table_is_refused_whole() -> None:
    rule = DraftLength(3)
    run(rule, linear_cost(0.010, 0.001), lambda _: 1.0, 100)
    table = rule.export()
    fresh = DraftLength(3)
    assert fresh.restore(json.loads(json.dumps(table))) is None
    assert fresh.export() == table
    # Restored costs are trusted: no classic or K trial before the rule runs the K that pays.
    fresh.speculative(4, 100, 3, 0.014, [3, 3, 3, 3])
    assert fresh.choose(4, 100) == 3
    cell = table["cells"][0]  # type: ignore[index]
    for bad in [None, [], {"max_drafts": 3}, {**table, "max_drafts": 4},
                {**table, "cells": [{**cell, "width": 0}]}, {**table, "cells": [{**cell, "seconds": {"0": -1.0}}]},
                {**table, "cells": [{**cell, "seconds": {"9": 0.1}}]},
                {**table, "cells": [{**cell, "seconds": {"0": float("nan")}}]},
                {**table, "cells": [{**cell, "extra": 1}]}, {**table, "cells": [cell] * 5000}]:
        other = DraftLength(3)
        assert other.restore(bad) is not None
        assert other.export() == {"max_drafts": 3, "cells": []}

def test_a_restored_cost_is_replaced_by_the_first_measurement_of_this_run() -> None:
    """Restored costs are trusted (no trial), but one that an earlier run measured badly (K = 3 at nearly twice
    its cost) is replaced by the first look at it, not averaged with it: the rule moves to K = 3 at once."""
    cost = linear_cost(0.010, 0.001)  # width 4: K = 3 pays best with drafts that always agree
    table = {"max_drafts": 3, "cells": [{"width": 4, "band": depth_band(100), "seconds": {
        "0": cost(4, 100, 0), "1": cost(4, 100, 1), "2": cost(4, 100, 2), "3": 0.06}}]}
    rule = DraftLength(3)
    assert rule.restore(table) is None
    _, chosen = run(rule, cost, lambda _: 1.0, 40)
    assert chosen[-20:].count(3) >= 19, chosen

def test_a_restored_classic_cost_is_replaced_by_its_first_measurement_and_a_verify_by_its_trials() -> None:
    rule = DraftLength(3)
    assert rule.restore({"max_drafts": 3, "cells": [{"width": 4, "band": 0, "seconds": {"0": 0.5, "3": 0.9}}]}) \
        is None
    rule.classic(4, 100, 0.01)
    rule.speculative(4, 100, 3, 0.05, [3] * 4)  # the verify's first step here: one-off costs
    rule.speculative(4, 100, 3, 0.02, [3] * 4)  # its second trial replaces it
    assert rule.export()["cells"] == [{"width": 4, "band": 0, "seconds": {"0": 0.01, "3": 0.02}}]

def test_restored_costs_look_at_the_drafts_before_judging_any_k() -> None:
    # A restart restores the step costs, not the acceptance (the traffic's). Judged by a guessed acceptance of
    # one half, three drafts would lose to this classic step (1.875 tokens in 0.02 s against 1 in 0.01 s) and
    # the rule would park a head that always agrees; it looks with K = 1 first, then K = 3 once (the deeper
    # drafts' acceptance), and runs K = 3 once it knows they agree.
    measured = DraftLength(3)
    costs = {0: 0.010, 1: 0.012, 2: 0.013, 3: 0.020}  # as measured; K = 3 costs 0.014 this run
    for k, seconds in costs.items():
        for _ in range(2):
            if k:
                measured.speculative(1, 100, k, seconds, [k])
            else:
                measured.classic(1, 100, seconds)
    rule = DraftLength(3)
    assert rule.restore(json.loads(json.dumps(measured.export()))) is None
    assert rule.choose(1, 100) == 1
    rule.speculative(1, 100, 1, 0.012, [1])
    assert rule.choose(1, 100) == 3
    rule.speculative(1, 100, 3, 0.014, [3])
    _, chosen = run(rule, lambda width, depth, k: {**costs, 3: 0.014}[k], lambda _: 1.0, 24, width=1)
    assert chosen[0] == 3 and chosen.count(3) >= 22  # (and a look at a neighbouring K now and then)
