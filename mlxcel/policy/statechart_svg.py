"""The statechart as an SVG picture, drawn from the same tables as the running machine and the mermaid diagram.

The page at ``GET /`` shows it with the current state lit, and the docs show the committed file
(``mlxcel statechart --write`` renders it; ``--check`` fails when it is stale). A layout engine (graphviz's
``dot``) would need a binary on every machine that checks it, and its output moves between versions; this
layout is fixed by the statechart's shape instead, and every arrow and label still comes from
:data:`~mlxcel.policy.statechart.TRANSITIONS`:

- the ``unavailable`` state on the left, its initial child on top and its other children below it;
- the other states in a column on the right, in declaration order;
- each arrow numbered, and the legend under the picture saying, per number, the event, its condition and where
  it goes (the boot arrows' numbers are the precedence: the first that matches is taken).

A transition of a shape this layout does not know raises, so a change to the tables cannot quietly go undrawn.
Only presentation attributes, no ``<style>``: the page's Content-Security-Policy forbids inline styles, and its
stylesheet restyles the states by class (``state``, ``compound``) and ``data-state``.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from typing import Any

from .statechart import BOOT_PRECEDENCE, INITIAL, LEAF_STATES, SEPARATOR, STATES, TRANSITIONS

WIDTH = 800
BOX_HEIGHT = 34
LEFT_X, LEFT_WIDTH = 44, 200
CHILD_X, CHILD_WIDTH = 72, 172
RIGHT_X, RIGHT_WIDTH = 540, 210
LEGEND_Y, LEGEND_LINE = 330, 17
FONT = 'font-family="ui-sans-serif, system-ui, sans-serif"'
#: The first state of the right column, where an arrow "from every other state" starts.
RIGHT_COLUMN_TOP = next(s for s in STATES if isinstance(s, str))


@dataclass(frozen=True)
class _Box:
    x: int
    y: int
    width: int

    @property
    def middle(self) -> int:
        return self.y + BOX_HEIGHT // 2


def _layout() -> tuple[dict[str, _Box], str]:
    """Where each leaf state's box is, and the name of the compound state that holds the initial one."""
    parent, _, initial_child = INITIAL.partition(SEPARATOR)
    compound = next(s for s in STATES if isinstance(s, dict) and s["name"] == parent)
    boxes = {INITIAL: _Box(LEFT_X, 60, LEFT_WIDTH)}
    others = [child for child in compound["children"] if child != initial_child]
    for index, child in enumerate(others):
        boxes[f"{parent}{SEPARATOR}{child}"] = _Box(CHILD_X, 140 + 56 * index, CHILD_WIDTH)
    column = [s for s in STATES if isinstance(s, str)]
    for index, state in enumerate(column):
        boxes[state] = _Box(RIGHT_X, 40 + 74 * index, RIGHT_WIDTH)
    assert set(boxes) == set(LEAF_STATES), "every leaf state has a place"
    return boxes, parent


def _label(transition: dict[str, Any]) -> str:
    text = transition["trigger"]
    conditions = [transition["conditions"]] if "conditions" in transition else []
    if "unless" in transition:
        conditions.append(f"!{transition['unless']}")
    return f"{text} [{' & '.join(conditions)}]" if conditions else text


def _arrow(number: int, path: str, at: tuple[float, float], dashed: bool = False) -> str:
    dash = ' stroke-dasharray="5 4"' if dashed else ""
    x, y = at
    return (f'<g class="transition" data-number="{number}"><path d="{path}" fill="none" stroke="#555" '
            f'stroke-width="1.4"{dash} marker-end="url(#arrow)"/>'
            f'<circle cx="{x:.0f}" cy="{y:.0f}" r="8" fill="white" stroke="#555"/>'
            f'<text x="{x:.0f}" y="{y + 3.5:.0f}" text-anchor="middle" font-size="10" {FONT}>{number}</text></g>')


def _route(number: int, transition: dict[str, Any], boxes: dict[str, _Box]) -> str:
    source, dest = transition["source"], transition["dest"]
    if isinstance(source, list):
        if sorted(source) != sorted(s for s in LEAF_STATES if s != dest):
            raise ValueError(f"no drawing for {transition}: a list of sources must be every other state")
        box, top = boxes[dest], boxes[RIGHT_COLUMN_TOP]
        start_x = top.x + top.width // 2
        path = f"M{start_x},{top.y} C{start_x},6 {box.x + 40},6 {box.x + 40},{box.y}"
        return _arrow(number, path, (start_x - 120, 15), dashed=True)
    origin = boxes[source]
    if dest is None:  # stays: a loop on its right side
        right = origin.x + origin.width
        path = (f"M{right},{origin.y + 8} C{right + 44},{origin.y - 6} {right + 44},{origin.y + 40} "
                f"{right},{origin.y + 26}")
        return _arrow(number, path, (right + 36, origin.middle))
    target = boxes[dest]
    if target.x == RIGHT_X and origin.x == RIGHT_X:  # down the right column
        x = origin.x + origin.width // 2
        return _arrow(number, f"M{x},{origin.y + BOX_HEIGHT} L{x},{target.y}",
                      (x + 16, (origin.y + BOX_HEIGHT + target.y) / 2))
    if target.x == RIGHT_X:  # across, from the left
        x0, y0, x1, y1 = origin.x + origin.width, origin.middle, target.x, target.middle
        return _arrow(number, f"M{x0},{y0} L{x1},{y1}", (x0 + (x1 - x0) * 0.82, y0 + (y1 - y0) * 0.82))
    if target.x == CHILD_X and origin.x == LEFT_X:  # down the left side, to a sibling
        x0, y0, x1, y1 = origin.x, origin.middle, target.x, target.middle
        bend = origin.x - 26
        return _arrow(number, f"M{x0},{y0} C{bend},{y0} {bend},{y1} {x1},{y1}", (bend + 8, y1 - 11))
    raise ValueError(f"no drawing for {transition}")



def _state(name: str, box: _Box) -> str:
    leaf = name.rpartition(SEPARATOR)[2]
    return (f'<g class="state" data-state="{escape(name)}"><rect x="{box.x}" y="{box.y}" width="{box.width}" '
            f'height="{BOX_HEIGHT}" rx="8" fill="white" stroke="#333" stroke-width="1.4"/>'
            f'<text x="{box.x + box.width // 2}" y="{box.middle + 4}" text-anchor="middle" font-size="13" '
            f'{FONT}>{escape(leaf)}</text></g>')


def render_svg() -> str:
    """The statechart as a standalone SVG document (its states, numbered arrows and their legend)."""
    boxes, compound = _layout()
    inner = [b for n, b in boxes.items() if n.startswith(compound + SEPARATOR)]
    bottom = max(b.y for b in inner) + BOX_HEIGHT + 16
    parts = [
        f'<g class="compound" data-state="{compound}"><rect x="16" y="30" width="{CHILD_X + CHILD_WIDTH}" '
        f'height="{bottom - 30}" rx="12" fill="#f4f4f4" stroke="#333" stroke-width="1.4"/>'
        f'<text x="{CHILD_X + CHILD_WIDTH + 4}" y="50" text-anchor="end" font-size="13" font-weight="bold" '
        f'{FONT}>{compound}</text></g>',
        *(_state(name, box) for name, box in boxes.items()),
        f'<circle cx="{LEFT_X - 20}" cy="{boxes[INITIAL].y - 14}" r="5" fill="#333"/>'
        f'<path d="M{LEFT_X - 16},{boxes[INITIAL].y - 11} L{LEFT_X + 10},{boxes[INITIAL].y}" stroke="#333" '
        f'stroke-width="1.4" marker-end="url(#arrow)"/>',
    ]
    legend = []
    for number, transition in enumerate(TRANSITIONS, start=1):
        parts.append(_route(number, transition, boxes))
        dest = transition["dest"] or transition["source"]
        source = "every other state" if isinstance(transition["source"], list) else transition["source"]
        y = LEGEND_Y + LEGEND_LINE * number
        legend.append(f'<text x="24" y="{y}" font-size="11" {FONT}><tspan font-weight="bold">{number}</tspan>  '
                      f'{escape(source)} \u2192 {escape(dest)}: {escape(_label(transition))}</text>')
    height = LEGEND_Y + LEGEND_LINE * (len(TRANSITIONS) + 1)
    return "\n".join([
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {WIDTH} {height}" width="{WIDTH}" height="{height}" '
        f'role="img" aria-labelledby="statechart-title">',
        '<title id="statechart-title">mlxcel adaptive MTP policy</title>',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
        *parts,
        f'<text x="16" y="{LEGEND_Y}" font-size="12" font-weight="bold" {FONT}>Arrows (the boot arrows '
        f'1-{len(BOOT_PRECEDENCE)} are tried in order: the first that matches is taken)</text>',
        *legend,
        "</svg>",
    ]) + "\n"
