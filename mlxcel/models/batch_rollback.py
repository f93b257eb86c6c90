"""Rolling a batch's KV caches back by a different number of positions in each row.

After a speculative step every row of the batch has fed the same K + 1 tokens
and kept its own prefix of them. mlx-lm's ``BatchKVCache`` holds the rows
right-justified at one shared index, with each row's unused front masked as
left padding, so a row that keeps fewer tokens than another cannot simply be
shortened. What every row rejected alike is trimmed off the end; each row's
remaining rejected positions are rotated round to its front, where they join
its left padding (what mlx-lm's right-padding ``prepare``/``finalize`` does, the
path its batched prompts take, byte for byte, but only the rows that move are
copied): no key of a rejected token stays visible to its row and no position
is left as a hole, and every row's RoPE offset goes back by what it rejected.
Worker thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache


def rollback_kv_rows(layers: Sequence[Any], rejected: Sequence[int]) -> None:
    """Take the last *rejected[i]* positions of row i out of every ``BatchKVCache`` of *layers*."""
    common = min(rejected)
    rest = [r - common for r in rejected]
    rotated = []
    for layer in layers:
        if common:
            layer.trim(common)  # every row: a shorter shared index, nothing moved
        if not any(rest) or layer.keys is None:
            continue
        if type(layer).finalize is BatchKVCache.finalize:
            rotated.append(layer)
        else:  # a finalize of its own: mlx-lm's path, whatever it does there
            layer.prepare(right_padding=rest)
            layer.finalize()
    if rotated:
        rotate_rows(rotated, rest)


def rotate_rows(layers: Sequence[Any], shifts: Sequence[int]) -> None:
    """What mlx-lm's ``prepare(right_padding=shifts)`` then ``finalize`` do to each ``BatchKVCache`` of *layers*
    (every row rotated right by its shift over the whole buffer, the shift then counted as left padding), the
    same bytes, copying only the rows that move: its ``dynamic_roll`` gathers every element of every row, 1.5 s
    for three layers of 16 rows over 2k keys on the 2-core CPU, where this takes about 11 ms with one row
    moving (``benchmarks/batch_rollback.py``). Evaluates the layers' arrays (and what they wait on)."""
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
    """*row* (1, H, L, D) rotated right by *shift* positions."""
    length = row.shape[2]
    return mx.concatenate([row[:, :, length - shift:], row[:, :, :length - shift]], axis=2)


def batch_rollback_supported(cache: list[Any]) -> str | None:
    """Why a batch of caches like *cache* (a sequence's own, or the batch's) cannot roll rows back apart,
    or None when it can: plain KV layers (a batch holds them as ``BatchKVCache``), recurrent ones, and a
    family's own cache class that says its batch rolls back by row (``rows_roll_back``)."""
    for layer in cache:
        if type(layer) not in (KVCache, BatchKVCache) and not isinstance(layer, ArraysCache) \
                and not getattr(layer, "rows_roll_back", False):
            return f"a {type(layer).__name__} layer cannot be rolled back row by row"
    return None
