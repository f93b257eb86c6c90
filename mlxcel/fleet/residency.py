"""Which loaded models make room for another, and which have been idle too long. Pure: no clock, no I/O.

A model is *busy* while a request of its own is in flight (a load counts as one);
only idle, unpinned models are unloaded, least recently used first. A model is
charged what it may hold (:func:`charge`): its weights, its drafter's, and the
bound of its prefix cache, which fills up to it.
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
    bytes: int = 0
    """What it is charged against the memory budget."""


def charge(weight_bytes: int, drafter_bytes: int, prefix_cache_bytes: int) -> int:
    """What a model is charged against the memory budget: its weights, its standalone drafter's, and its prefix
    cache's bound."""
    return weight_bytes + drafter_bytes + prefix_cache_bytes


def to_unload_for(residents: Sequence[Resident], need: int, budget: int | None,
                  max_loaded: int | None) -> list[str] | None:
    """The models to unload, least recently used first, so that one more charged *need* bytes may load with at
    most *max_loaded* resident and their charges within *budget* (None: no bound); [] when it fits as things
    are; None when it cannot fit until a model now busy or pinned goes idle (the caller waits, within its
    bound). A *need* over the whole budget never fits: the caller refuses it before asking."""
    count, used = len(residents), sum(r.bytes for r in residents)
    unload: list[str] = []
    for candidate in sorted((r for r in residents if not r.pinned and not r.busy), key=lambda r: r.last_used):
        if _fits(count, used, need, budget, max_loaded):
            return unload
        unload.append(candidate.name)
        count, used = count - 1, used - candidate.bytes
    return unload if _fits(count, used, need, budget, max_loaded) else None


def _fits(count: int, used: int, need: int, budget: int | None, max_loaded: int | None) -> bool:
    return (max_loaded is None or count < max_loaded) and (budget is None or used + need <= budget)


def size(count: int) -> str:
    """*count* bytes for a person: ``812 kB``, ``1.65 MB``, ``24.0 GB`` (decimal units, three digits)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            value = count / scale
            return f"{value:.3g} {unit}" if value < 100 else f"{value:.0f} {unit}"
    return f"{count} B"


def idle_too_long(residents: Sequence[Resident], now: float) -> list[str]:
    """The unpinned, idle models whose idle time has reached their ``idle_unload``."""
    return [r.name for r in residents if r.idle_unload is not None and not r.pinned and not r.busy
            and now - r.last_used >= r.idle_unload]


def next_idle_deadline(residents: Sequence[Resident]) -> float | None:
    """The earliest moment (on the residents' clock) at which :func:`idle_too_long` may name one more model."""
    deadlines = [r.last_used + r.idle_unload for r in residents
                 if r.idle_unload is not None and not r.pinned and not r.busy]
    return min(deadlines, default=None)
