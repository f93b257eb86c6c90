"""The persisted table of batch step costs (:meth:`~.draft_length.DraftLength.export`), read back at a start, and
the context-depth bands its cells are kept by.

Pure Python. The file is written atomically (:meth:`~.hints.HintStore.save_batch`), but a disk error or a hand
edit can leave anything in it: a table is taken whole or not at all, and what is wrong with it is said in words.
"""

from __future__ import annotations

import math

#: At most this many (width, band) cells are read from a persisted table.
MAX_CELLS = 4096
#: Depth bands: below 1,024 tokens of context, then each doubling (1k-2k, 2k-4k, ...).
FIRST_BAND_TOKENS = 1024


def depth_band(depth: int) -> int:
    """The context-depth band of *depth* tokens: 0 below 1,024, then one per doubling."""
    return 0 if depth < FIRST_BAND_TOKENS else int(math.log2(depth / FIRST_BAND_TOKENS)) + 1


def band_bounds(band: int) -> tuple[int, int]:
    """The first and last depth (tokens) of *band*."""
    if band == 0:
        return 0, FIRST_BAND_TOKENS - 1
    return FIRST_BAND_TOKENS << (band - 1), (FIRST_BAND_TOKENS << band) - 1


def read_table(table: object, max_drafts: int) -> dict[tuple[int, int], dict[int, float]] | str:
    """(width, band) -> K -> seconds of a step, from *table* as a server drafting up to *max_drafts* wrote it;
    or why not."""
    if not isinstance(table, dict) or set(table) != {"max_drafts", "cells"}:
        return "not a table of step costs"
    if table["max_drafts"] != max_drafts:
        return f"measured for up to {table['max_drafts']!r} drafts, this server drafts up to {max_drafts}"
    entries = table["cells"]
    if not isinstance(entries, list) or len(entries) > MAX_CELLS:
        return f"its cells are not a list of at most {MAX_CELLS}"
    cells: dict[tuple[int, int], dict[int, float]] = {}
    for entry in entries:
        if not isinstance(entry, dict) or set(entry) != {"width", "band", "seconds"}:
            return "a cell is not a width, a band and its seconds"
        width, band, seconds = entry["width"], entry["band"], entry["seconds"]
        if not (type(width) is int and 1 <= width <= 1 << 16 and type(band) is int and 0 <= band <= 64
                and isinstance(seconds, dict)):
            return "a cell's width, band or seconds is out of range"
        costs = {}
        for k, value in seconds.items():
            if not (isinstance(k, str) and k.isdigit() and int(k) <= max_drafts
                    and isinstance(value, float) and math.isfinite(value) and value > 0):
                return "a cell's seconds are not positive numbers by K"
            costs[int(k)] = value
        cells[(width, band)] = costs
    return cells
