"""The statechart's picture (mlxcel.policy.statechart_svg): drawn from the tables, every state and arrow."""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

import pytest

from mlxcel.policy import statechart, statechart_svg
from mlxcel.policy.statechart import LEAF_STATES, TRANSITIONS

SVG = "{http://www.w3.org/2000/svg}"


def test_every_state_and_every_arrow_is_drawn_and_listed() -> None:
    root = ET.fromstring(statechart_svg.render_svg())
    states = [g.get("data-state") for g in root.iter(f"{SVG}g") if g.get("class") == "state"]
    assert sorted(states) == sorted(LEAF_STATES)
    arrows = [g.get("data-number") for g in root.iter(f"{SVG}g") if g.get("class") == "transition"]
    assert arrows == [str(n) for n in range(1, len(TRANSITIONS) + 1)]
    legend = "".join(root.itertext())
    for number, transition in enumerate(TRANSITIONS, start=1):
        assert re.search(rf"{number}  \S.* \u2192 .*: {re.escape(transition['trigger'])}", legend), transition
    assert "resolve [probe_vetoed & !inexact_allowed]" in legend


def test_an_arrow_of_a_shape_it_cannot_draw_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    backwards = {"trigger": "relapse", "source": statechart.SETTLED, "dest": statechart.unavailable("sharded")}
    monkeypatch.setattr(statechart_svg, "TRANSITIONS", [*TRANSITIONS, backwards])
    with pytest.raises(ValueError, match="no drawing for"):
        statechart_svg.render_svg()
