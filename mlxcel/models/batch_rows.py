"""Rows joining and leaving a batch: each costs one copy of the batch's caches, not several.

mlx-lm's ``GenerationBatch`` copies a layer's arrays whenever its rows change, and
at 16 rows over 2k tokens of context on the 2-core CPU a copy of the batch's
caches costs a quarter of a second or more (docs/benchmarks.md, 2026-12-06,
eleventh). Two of its copies are avoidable:

- ``extend`` takes one batch at a time and concatenates every layer afresh. The
  continuous batch prefills each prompt alone (a row's bytes are its own), so
  the rows that finished their prompts in one step joined one by one, a copy of
  the whole batch each. :func:`join_rows` merges them all at once: each layer's
  arrays are concatenated once over the batch and every new row.
- ``filter`` gathers the kept rows of ``BatchKVCache``'s whole buffer, then
  slices off the left padding every kept row shares: a view, which the next
  step's write into the cache copies whole once more. :func:`filter_rows`
  copies the kept rows' positions past that padding: one copy, a buffer the
  next write fills in place.

Either way every row holds the same bytes where any step reads (each row
right-justified at the batch's shared index, the rest masked as its left
padding), as mlx-lm leaves them. A cache kind that is not mlx-lm's plain
``BatchKVCache`` or ``ArraysCache`` keeps its own ``extend`` and ``filter``.
Worker thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import GenerationBatch
from mlx_lm.models.cache import ArraysCache, BatchKVCache


def join_rows(batch: Any, joined: Sequence[Any]) -> None:
    """Extend mlx-lm's ``GenerationBatch`` *batch* with each of *joined* (batches of the same model), in order,
    as ``batch.extend`` on each in turn would, copying each layer's arrays once."""
    caches = [part.prompt_cache for part in (batch, *joined) if part.prompt_cache]
    if len(caches) < 2:  # nothing to copy: mlx-lm's own extend takes the one cache there is
        for part in joined:
            batch.extend(part)
        return
    merged = [join_layers(layers) for layers in zip(*caches, strict=True)]
    for part in joined:
        part.prompt_cache = []  # its caches are in `merged`: extend takes its rows' lists and tokens only
        batch.extend(part)
    batch.prompt_cache = merged


def join_layers(layers: Sequence[Any]) -> Any:
    """One layer of every part, its rows in order, as the first of *layers* (extended in place)."""
    first, *rest = layers
    if all(type(layer) is BatchKVCache for layer in layers):
        _join_kv(layers)
    elif all(type(layer) is ArraysCache for layer in layers):
        _join_arrays(layers)
    else:
        for layer in rest:
            first.extend(layer)
    return first


def _join_kv(layers: Sequence[Any]) -> None:
    """``BatchKVCache.extend`` over all of *layers* at once: every row right-justified at the largest index."""
    first = layers[0]
    holding = [layer for layer in layers if layer.keys is not None]
    if not holding:
        first.left_padding = mx.concatenate([layer.left_padding for layer in layers])
        first.offset = mx.concatenate([layer.offset for layer in layers])
        return
    index = max(layer._idx for layer in layers)
    size = max(layer.keys.shape[2] for layer in holding)
    _, heads, _, key_dim = holding[0].keys.shape
    value_dim = holding[0].values.shape[3]
    dtype = holding[0].keys.dtype
    keys, values = [], []
    for layer in layers:
        k, v = layer.keys, layer.values
        if k is None:
            rows = layer.offset.shape[0]
            k, v = mx.zeros((rows, heads, 0, key_dim), dtype), mx.zeros((rows, heads, 0, value_dim), dtype)
        left = index - layer._idx
        right = size - k.shape[2] - left
        if right < 0:  # past the index: nothing any row reads
            k, v, right = k[..., :right, :], v[..., :right, :], 0
        if left or right:
            k = mx.pad(k, [(0, 0), (0, 0), (left, right), (0, 0)])
            v = mx.pad(v, [(0, 0), (0, 0), (left, right), (0, 0)])
        keys.append(k)
        values.append(v)
    first.left_padding = mx.concatenate([layer.left_padding + (index - layer._idx) for layer in layers])
    first.offset = mx.concatenate([layer.offset for layer in layers])
    first.keys, first.values = mx.concatenate(keys), mx.concatenate(values)
    first._idx = index


def _join_arrays(layers: Sequence[Any]) -> None:
    """``ArraysCache.extend`` over all of *layers* at once: a state a part does not hold is zeros for its rows."""
    sizes = [layer.batch_size for layer in layers]

    def joined(parts: list[Any]) -> Any:
        held = next((part for part in parts if part is not None), None)
        if held is None:
            return None
        return mx.concatenate([part if part is not None else mx.zeros((rows, *held.shape[1:]), held.dtype)
                               for part, rows in zip(parts, sizes, strict=True)])

    first = layers[0]
    first.cache = [joined([layer.cache[e] for layer in layers]) for e in range(len(first.cache))]
    first.left_padding = joined([layer.left_padding for layer in layers])
    first.lengths = joined([layer.lengths for layer in layers])


def filter_rows(batch: Any, keep: list[int]) -> None:
    """``GenerationBatch.filter(keep)`` of mlx-lm's *batch*, each layer by :func:`filter_layer`."""
    cache, batch.prompt_cache = batch.prompt_cache, []
    try:
        GenerationBatch.filter(batch, keep)  # its rows' lists and tokens: no cache to filter
    finally:
        batch.prompt_cache = cache
    if not keep:
        cache.clear()
        return
    for layer in cache:
        filter_layer(layer, keep)


def filter_layer(layer: Any, keep: list[int]) -> None:
    """``layer.filter(keep)``; for a plain ``BatchKVCache``, the kept rows' positions past the padding they all
    share copied once into a buffer the next write fills in place (mlx-lm gathers the whole buffer, then leaves
    a view past that padding, which the next write copies whole again; a gather from such a view is slower
    than copying runs of rows)."""
    if type(layer) is not BatchKVCache:
        layer.filter(keep)
        return
    rows = mx.array(keep)
    padding = layer.left_padding[rows]
    shared = min(cast(list[int], padding.tolist()))
    if layer.keys is not None:
        runs = _runs(keep)
        layer.keys = mx.concatenate([layer.keys[a:b, :, shared:] for a, b in runs])
        layer.values = mx.concatenate([layer.values[a:b, :, shared:] for a, b in runs])
    layer.offset = layer.offset[rows]
    layer.left_padding = padding - shared
    layer._idx -= shared


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """*rows* as (start, stop) ranges of consecutive rows, in order."""
    runs: list[tuple[int, int]] = []
    for row in rows:
        if runs and runs[-1][1] == row:
            runs[-1] = (runs[-1][0], row + 1)
        else:
            runs.append((row, row + 1))
    return runs
