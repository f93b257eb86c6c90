"""A server's batch steps, read back from its log: the tokens it made, and the seconds they took, inside its steps.

A server run with ``--mtp --log-level debug`` logs each batch step (``mlxcel.engine.step_clock``): its rows, its
drafts (or a run of classic steps) and its seconds, and each row's kept drafts. The rate inside the steps of one
width leaves out what a client's round also holds (admission, prefill, the round's ragged end), which moves a
two-round cell by several percent from one server to another; two servers' rates inside their steps compare the
steps alone, the draft lengths a rule chose among them. A server without ``--mtp`` logs no steps.
"""

from __future__ import annotations

import re

from benchmarks._common import SERVER_LOGS

_STEP = re.compile(r"step: (?P<rows>\d+) rows at depth \d+, (?:classic, (?P<classic>[\d.]+) s a step over "
                   r"(?P<run>\d+)|\d+ drafts, (?P<seconds>[\d.]+) s(?P<note>[^,]*(?:\([^)]*\))?), "
                   r"kept \[(?P<kept>[\d, ]*)\])")


class StepLog:
    """One server's log, read from a mark on: :meth:`mark` before a width's timed rounds, :meth:`inside` after."""

    def __init__(self, url: str) -> None:
        self.path = SERVER_LOGS.get(url)  # None: not a server benchmarks._common.server started
        self.offset = 0

    def mark(self) -> None:
        self.offset = self.path.stat().st_size if self.path else 0

    def inside(self, rows: int) -> tuple[int, float]:
        """Tokens made and seconds spent in the steps of exactly *rows* rows logged since the mark. A step whose rows
        changed (one joined or left: its time holds the join) is left out; every other step counts, the first at
        more drafts than the step before included (its page faults are what switching costs)."""
        if self.path is None:
            return 0, 0.0
        with self.path.open() as text:
            text.seek(self.offset)
            steps = [match for match in map(_STEP.search, text) if match and int(match["rows"]) == rows]
        tokens, seconds = 0, 0.0
        for step in steps:
            if step["classic"] is not None:
                tokens += rows * int(step["run"])
                seconds += float(step["classic"]) * int(step["run"])
            elif "rows changed" not in step["note"]:
                tokens += sum(int(kept) + 1 for kept in step["kept"].split(","))
                seconds += float(step["seconds"])
        return tokens, seconds
