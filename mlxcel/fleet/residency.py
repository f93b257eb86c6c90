"""Which loaded models make room for another, and which have been idle too long. Pure: no clock, no I/O.

A model is *busy* while a request of its own is in flight (a load counts as one);
only idle, unpinned models are unloaded, least recently used first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Resident:
    """A loaded (or loading) model as the choice sees it."""

    name: str
    pinned: bool
    busy: bool
    last_used: float
    """When its last request began or ended (any clock, the same for all)."""
    idle_unload: float | None = None
    """Seconds idle after which it is unloaded; None: never for idleness."""


def to_unload_for_one_more(residents: Sequence[Resident], max_loaded: int | None) -> list[str] | None:
    """The models to unload, least recently used first, so that one more may load with at most *max_loaded*
    resident (None: no bound); [] when it fits as things are; None when it cannot fit until a model now busy
    or pinned goes idle (the caller waits, within its bound)."""
    if max_loaded is None or len(residents) < max_loaded:
        return []
    candidates = sorted((r for r in residents if not r.pinned and not r.busy), key=lambda r: r.last_used)
    excess = len(residents) - max_loaded + 1
    if len(candidates) < excess:
        return None
    return [r.name for r in candidates[:excess]]


def idle_too_long(residents: Sequence[Resident], now: float) -> list[str]:
    """The unpinned, idle models whose idle time has reached their ``idle_unload``."""
    return [r.name for r in residents if r.idle_unload is not None and not r.pinned and not r.busy
            and now - r.last_used >= r.idle_unload]


def next_idle_deadline(residents: Sequence[Resident]) -> float | None:
    """The earliest moment (on the residents' clock) at which :func:`idle_too_long` may name one more model."""
    deadlines = [r.last_used + r.idle_unload for r in residents
                 if r.idle_unload is not None and not r.pinned and not r.busy]
    return min(deadlines, default=None)
