"""Rolling a batch's KV caches back by a different number of positions in each row.

After a speculative step every row of the batch has fed the same K + 1 tokens
and kept its own prefix of them. mlx-lm's ``BatchKVCache`` holds the rows
right-justified at one shared index, with each row's unused front masked as
left padding, so a row that keeps fewer tokens than another cannot simply be
shortened. Some number of rejected positions is trimmed off the end of every
row; a row that rejected more has the rest rotated round to its front, where
they join its left padding (what mlx-lm's right-padding ``prepare``/``finalize``
does, the path its batched prompts take, byte for byte, but only the rows that
move are copied), and a row that rejected fewer is rotated the other way, its
kept keys moved forward over padding it had. No key of a rejected token stays
visible to its row and no position is left as a hole, and every row's RoPE
offset goes back by what it rejected.

How much is trimmed is chosen to move the fewest rows: a moving row's keys and
values are copied over the buffer's whole length (a few ms a layer over 2k
keys), so when fifteen rows of sixteen rejected a draft the sixteenth kept,
trimming the fifteen's draft and moving the sixteenth forward copies one row,
not fifteen. Worker thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache


def rollback_kv_rows(layers: Sequence[Any], rejected: Sequence[int]) -> None:
    """Take the last *rejected[i]* positions of row i out of every ``BatchKVCache`` of *layers*."""
    common = min(rejected)
    by_shifts: dict[tuple[int, ...], list[Any]] = {}
    for layer in layers:
        plain = type(layer).finalize is BatchKVCache.finalize  # else a finalize of its own: mlx-lm's path
        trimmed = fewest_moves(rejected, layer.left_padding.tolist()) if plain and layer.keys is not None else common
        if trimmed:
            layer.trim(trimmed)  # every row: a shorter shared index, nothing moved
        shifts = tuple(r - trimmed for r in rejected)
        if not any(shifts) or layer.keys is None:
            continue
        if plain:
            by_shifts.setdefault(shifts, []).append(layer)
        else:  # whatever it does there (rotations to the right only)
            layer.prepare(right_padding=list(shifts))
            layer.finalize()
    for shifts, rotated in by_shifts.items():
        rotate_rows(rotated, shifts)


def fewest_moves(rejected: Sequence[int], padding: Sequence[int]) -> int:
    """How many positions to trim off every row so that the fewest rows move: a row that rejected more than
    that is rotated right by the difference, one that rejected fewer left, which it can only be over as much
    left padding as it holds. Among equal counts, the least trimmed."""
    def moves(trim: int) -> int | None:
        if any(r < trim and trim - r > pad for r, pad in zip(rejected, padding, strict=True)):
            return None
        return sum(r != trim for r in rejected)

    counted = [(count, trim) for trim in sorted(set(rejected)) if (count := moves(trim)) is not None]
    return min(counted)[1]  # the least rejected always counts: no row moves left


def rotate_rows(layers: Sequence[Any], shifts: Sequence[int]) -> None:
    """Every row of each ``BatchKVCache`` of *layers* rotated right by its shift over the whole buffer (left by a
    negative one), the shift then counted as left padding and taken off its RoPE offset: for positive shifts what
    mlx-lm's ``prepare(right_padding=shifts)`` then ``finalize`` do, the same bytes, copying only the rows that
    move: its ``dynamic_roll`` gathers every element of every row, 1.5 s for three layers of 16 rows over 2k keys
    on the 2-core CPU, where this takes about 11 ms with one row moving (``benchmarks/batch_rollback.py``).
    Evaluates the layers' arrays (and what they wait on)."""
    moving = [(i, s) for i, s in enumerate(shifts) if s]
    rows = [[_rotated(array[i:i + 1], s) for i, s in moving]
            for layer in layers for array in (layer.keys, layer.values)]
    # The rotated rows are made first and on their own: then nothing but its layer holds a buffer, and MLX writes
    # each row into it in place (it donates a buffer only its array holds) instead of copying the whole buffer.
    mx.eval(rows)
    padding = mx.array(list(shifts))
    pieces = iter(rows)
    for layer in layers:
        for name in ("keys", "values"):
            array = getattr(layer, name)
            for (i, _), row in zip(moving, next(pieces), strict=True):
                array[i:i + 1] = row
        layer.offset = layer.offset - padding
        layer.left_padding = layer.left_padding + padding


def _rotated(row: Any, shift: int) -> Any:
    """*row* (1, H, L, D) rotated right by *shift* positions (left by a negative *shift*)."""
    cut = row.shape[2] - shift % row.shape[2]
    return mx.concatenate([row[:, :, cut:], row[:, :, :cut]], axis=2)


def batch_rollback_supported(cache: list[Any]) -> str | None:
    """Why a batch of caches like *cache* (a sequence's own, or the batch's) cannot roll rows back apart,
    or None when it can: plain KV layers (a batch holds them as ``BatchKVCache``), recurrent ones, and a
    family's own cache class that says its batch rolls back by row (``rows_roll_back``)."""
    for layer in cache:
        if type(layer) not in (KVCache, BatchKVCache) and not isinstance(layer, ArraysCache) \
                and not getattr(layer, "rows_roll_back", False):
            return f"a {type(layer).__name__} layer cannot be rolled back row by row"
    return None
