"""What the rule of K does, as the policy endpoint publishes it beside the B=1 fields (its ``batch`` field).

Pure data: :class:`~.draft_length.DraftLength` makes the cells, the engine adds
whether the batch can speculate at all, and :mod:`.snapshot` carries it to the
wire.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BatchCell:
    """What the rule does at one batch width and depth band, as published."""

    width: int
    min_depth: int
    max_depth: int
    drafts: int
    """The K it runs there (0: the classic step, speculation parked or not paying)."""
    estimated_speedup: float | None
    """Tokens per second at that K over the classic step's, from the measured costs (None: not measured)."""


@dataclass(frozen=True, slots=True)
class BatchView:
    """Speculation inside the continuous batch, as the policy endpoint publishes it beside the B=1 fields."""

    speculates: bool
    """Whether the batch can speculate at all (a drafter that batches, an exact verify, no pin off)."""
    reason: str | None
    """Why it cannot, when it cannot."""
    cells: tuple[BatchCell, ...] = ()
    inexact: tuple[tuple[int, str], ...] = ()
    """(width, why) for each batch width whose verify the exactness probe found not byte for byte the batch's
    classic steps: the classic step runs there."""

    def to_wire(self) -> dict[str, object]:
        wire: dict[str, object] = {
            "speculates": self.speculates, "reason": self.reason,
            "cells": [{"width": c.width, "min_depth": c.min_depth, "max_depth": c.max_depth,
                       "drafts": c.drafts, "estimated_speedup": c.estimated_speedup} for c in self.cells]}
        if self.inexact:  # additive: present only when a width was declined
            wire["inexact_widths"] = [{"width": width, "detail": detail} for width, detail in self.inexact]
        return wire
