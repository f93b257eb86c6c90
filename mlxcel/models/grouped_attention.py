"""One query's attention, its query heads grouped by the KV head they share and its keys summed in blocks
counted from the newest (CPU backend).

Two properties, both measured on this project's machine (docs/benchmarks.md, "Decode at depth: the query
heads grouped" and "A row's bytes are its own"):

- **Speed at depth.** mlx's CPU ``scaled_dot_product_attention`` is composed of ops: for a grouped-query
  model it broadcasts each KV head to its query heads and runs one matrix-vector product per *query* head,
  and the BLAS packs that head's whole key (and value) cache for each. Putting the query heads that share a
  KV head into the rows of one product reads each KV cache once: 40 ms a layer instead of 116 at 8k keys
  for 8 query heads over 2 KV heads of 256, a batch of 8.
- **Bytes that do not depend on what lies in front of a row's keys.** A continuous batch holds its rows
  right-justified behind masked left padding, and how much padding a row has depends on the other rows and
  on speculation's rollbacks (which turn a row's rejected positions into padding). mlx's kernel, and one
  product over all the keys, sum over a number of keys that includes the padding, and a BLAS picks its
  blocking (and on OpenBLAS, for small products, its kernel) by that number: the same keys behind 1, 3 or
  17 masked columns gave other bytes for hundreds of cache lengths. Here the keys are summed in blocks of
  :data:`CHUNK` counted back from the newest, each block one product of one fixed shape (the oldest block
  topped up with masked zeros), and the blocks' sums added oldest first; a masked key weighs exactly zero,
  so a row's result is the same bytes for any padding and any cache length around it. That is what makes a
  request's text independent of the batch's layout, with speculation on or off.

Applied to every lone query on the MLX thread (a decode step, a drafter's draft, a ``rows`` verify's query,
a batch's step), at every depth, where there are no attention sinks and no other keyword: mlxcel's steps
then attend alike whether a request runs alone or in a batch. A thread outside :mod:`.attention`'s
``mlx_thread`` (mlx-lm's own decode beside a test) keeps mlx's attention, whose rounding differs in the
last bits. The functions here are pure functions of their arrays.
"""

from __future__ import annotations

from typing import Any

#: Keys per block of the sums. Fixed: a block's product must have one shape at every cache length. 64 keeps
#: the topped-up oldest block cheap at short contexts; from 1k keys blocks of 64 cost nothing for heads 64-128
#: wide (docs/benchmarks.md, "A row's bytes are its own").
CHUNK = 64


def grouped_over(attention: Any) -> Any:
    """*attention* (mlx's signature), with a lone query (per-query mask or none, no sinks) computed by
    :func:`grouped`."""
    def scaled_dot_product_attention(q: Any, k: Any, v: Any, *, scale: float, mask: Any = None,
                                     sinks: Any = None, **kwargs: Any) -> Any:
        if (q.shape[2] == 1 and sinks is None and not kwargs and q.shape[1] % k.shape[1] == 0
                and _per_query(mask, q.shape[1])):
            # A lone query is the last position: "causal" masks nothing.
            return grouped(q, k, v, scale, None if isinstance(mask, str) else mask)
        if sinks is not None:
            kwargs["sinks"] = sinks
        return attention(q, k, v, scale=scale, mask=mask, **kwargs)

    return scaled_dot_product_attention


def grouped(q: Any, k: Any, v: Any, scale: float, mask: Any = None) -> Any:
    """Attention of one query *q* (B, H, 1, D) over *k*, *v* (B, KV, S, D): the H / KV query heads of each
    KV head in the rows of one product, the keys in blocks of :data:`CHUNK` from the newest. *mask*: None, or
    an array over the keys (boolean: where to attend; else added to the scores) whose head axis, if any, is 1
    or H. Scores and weights in float32, a boolean mask's excluded scores at the lowest float32."""
    import mlx.core as mx

    batch, heads, _, dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = heads // kv_heads
    rows = (q * mx.array(scale, q.dtype)).reshape(batch, kv_heads, 1, group, dim)
    if mask is None:
        mask = mx.ones((1, 1, 1, length), mx.bool_)  # the topped-up block's zeros must be masked
    mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    mask = (mask.reshape(mask.shape[0], kv_heads, group, length) if mask.shape[1] == heads
            else mask.reshape(mask.shape[0], 1, 1, length))
    blocks = -(-length // CHUNK)
    front = length - (blocks - 1) * CHUNK  # keys in the oldest block, topped up to CHUNK
    parts = [_scores(rows, _older(k, CHUNK - front, front), _older(v, CHUNK - front, front),
                     _older(mask, CHUNK - front, front, masked=True), 1)]
    if blocks > 1:
        parts.append(_scores(rows, k[:, :, front:], v[:, :, front:], mask[..., front:], blocks - 1))
    top = parts[0][0].max(axis=(-3, -1), keepdims=True)
    for scores, _ in parts[1:]:
        top = mx.maximum(top, scores.max(axis=(-3, -1), keepdims=True))
    weights = [mx.exp(scores - top) for scores, _ in parts]
    # Each block's sums, then the blocks added in order: a block of masked keys adds exact zeros.
    numerator = mx.concatenate([(w.astype(values.dtype) @ values).astype(mx.float32)
                                for w, (_, values) in zip(weights, parts, strict=True)], axis=2).sum(axis=2)
    denominator = mx.concatenate([w.sum(axis=-1) for w in weights], axis=2).sum(axis=2)
    return (numerator / denominator[..., None]).astype(q.dtype).reshape(batch, heads, 1, v.shape[-1])


def _older(array: Any, zeros: int, front: int, masked: bool = False) -> Any:
    """The first *front* positions of *array*'s last key axis (-2 for keys and values, -1 for a mask) after
    *zeros* masked positions: the oldest block, topped up."""
    import mlx.core as mx

    axis = -1 if masked else -2
    head = array[..., :front] if masked else array[..., :front, :]
    if not zeros:
        return head
    shape = list(head.shape)
    shape[axis] = zeros
    if masked:
        filler = mx.zeros(shape, mx.bool_) if array.dtype == mx.bool_ else mx.full(shape, -mx.inf, array.dtype)
    else:
        filler = mx.zeros(shape, array.dtype)
    return mx.concatenate([filler, head], axis=axis)


def _scores(rows: Any, keys: Any, values: Any, mask: Any, blocks: int) -> tuple[Any, Any]:
    """The masked float32 scores (B, KV, blocks, group, CHUNK) of *rows* against *keys* cut into *blocks*
    blocks, and *values* cut alike."""
    import mlx.core as mx

    batch, kv_heads, _, dim = keys.shape
    keys = keys.reshape(batch, kv_heads, blocks, CHUNK, dim)
    values = values.reshape(batch, kv_heads, blocks, CHUNK, values.shape[-1])
    scores = (rows @ keys.swapaxes(-1, -2)).astype(mx.float32)
    mask = mask.reshape(*mask.shape[:-1], blocks, CHUNK).swapaxes(-2, -3)
    scores = (mx.where(mask, scores, mx.array(mx.finfo(mx.float32).min, mx.float32))
              if mask.dtype == mx.bool_ else scores + mask.astype(mx.float32))
    return scores, values


def _per_query(mask: Any, heads: int) -> bool:
    """Whether a lone query's *mask* is none, "causal" (nothing, for the last position), or one row
    over the keys, shared by the heads or one per head."""
    if mask is None or isinstance(mask, str):
        return mask is None or mask == "causal"
    if mask.ndim < 4:
        return mask.ndim >= 1 and all(size == 1 for size in mask.shape[:-1])
    return mask.ndim == 4 and mask.shape[-2] == 1 and mask.shape[1] in (1, heads)
