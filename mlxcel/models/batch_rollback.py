"""Rolling a batch's KV caches back by a different number of positions in each row.

After a speculative step every row of the batch has fed the same K + 1 tokens
and kept its own prefix of them. mlx-lm's ``BatchKVCache`` holds the rows
right-justified at one shared index, with each row's unused front masked as
left padding, so a row that keeps fewer tokens than another cannot simply be
shortened. What every row rejected alike is trimmed off the end; each row's
remaining rejected positions are rotated round to its front, where they join
its left padding (mlx-lm's own right-padding ``prepare``/``finalize``, the path
its batched prompts take): no key of a rejected token stays visible to its row
and no position is left as a hole, and every row's RoPE offset goes back by
what it rejected. Worker thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def rollback_kv_rows(layer: Any, rejected: Sequence[int]) -> None:
    """Take the last *rejected[i]* positions of row i out of a ``BatchKVCache`` *layer*."""
    common = min(rejected)
    if common:
        layer.trim(common)  # every row: a shorter shared index, nothing moved
    rest = [r - common for r in rejected]
    if any(rest):
        layer.prepare(right_padding=rest)
        layer.finalize()


def batch_rollback_supported(cache: list[Any]) -> str | None:
    """Why a batch of caches like *cache* (a sequence's own, or the batch's) cannot roll rows back apart,
    or None when it can: plain KV layers (a batch holds them as ``BatchKVCache``), recurrent ones, and a
    family's own cache class that says its batch rolls back by row (``rows_roll_back``)."""
    from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

    for layer in cache:
        if type(layer) not in (KVCache, BatchKVCache) and not isinstance(layer, ArraysCache) \
                and not getattr(layer, "rows_roll_back", False):
            return f"a {type(layer).__name__} layer cannot be rolled back row by row"
    return None
