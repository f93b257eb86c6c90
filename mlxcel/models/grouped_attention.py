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
    blocks = -(-length // CHUNK)
    front = length - (blocks - 1) * CHUNK  # keys in the oldest block, topped up to CHUNK
    keys, values = _blocks(k, front), _blocks(v, front)
    # One array of scores (B, KV, blocks, group, CHUNK) for one mask, one maximum and one exponential: at a
    # short context the operations' count is the cost. The keys themselves stay views of the cache (the
    # products read them in place); only the oldest block is copied, to be topped up.
    scores = _joined([rows @ part.swapaxes(-1, -2) for part in keys]).astype(mx.float32)
    scores = _masked(scores, mask, CHUNK - front)
    weights = mx.exp(scores - scores.max(axis=(-3, -1), keepdims=True))
    cast = weights.astype(v.dtype)
    # Each block's sums, then the blocks added in order: a block of masked keys adds exact zeros.
    sums = _joined([cast[:, :, :1] @ values[0]] + [cast[:, :, 1:] @ part for part in values[1:]])
    numerator = sums.astype(mx.float32).sum(axis=2)
    denominator = weights.sum(axis=-1).sum(axis=2)
    return (numerator / denominator[..., None]).astype(q.dtype).reshape(batch, heads, 1, v.shape[-1])


def _blocks(array: Any, front: int) -> list[Any]:
    """*array*'s keys (B, KV, S, D) as blocks (B, KV, n, CHUNK, D): the oldest *front* keys topped up in front
    with zeros, then the rest (if any) as a view."""
    import mlx.core as mx

    batch, kv_heads, length, dim = array.shape
    oldest = array[:, :, :front]
    if front < CHUNK:
        oldest = mx.concatenate([mx.zeros((batch, kv_heads, CHUNK - front, dim), array.dtype), oldest], axis=2)
    parts = [oldest.reshape(batch, kv_heads, 1, CHUNK, dim)]
    if length > front:
        parts.append(array[:, :, front:].reshape(batch, kv_heads, (length - front) // CHUNK, CHUNK, dim))
    return parts


def _joined(parts: list[Any]) -> Any:
    """*parts* joined on the blocks' axis."""
    import mlx.core as mx

    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=2)


def _masked(scores: Any, mask: Any, zeros: int) -> Any:
    """*scores* (B, KV, blocks, group, CHUNK) with *mask* (None, or over the keys; its head axis, if any, 1 or
    KV x group) applied and the *zeros* keys that top up the oldest block masked."""
    import mlx.core as mx

    if mask is None and not zeros:
        return scores
    low = mx.array(mx.finfo(mx.float32).min, mx.float32)
    _, kv_heads, blocks, group, chunk = scores.shape
    if mask is None:
        return mx.where((mx.arange(blocks * chunk) >= zeros).reshape(blocks, 1, chunk), scores, low)
    mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    mask = (mask.reshape(mask.shape[0], kv_heads, group, -1) if mask.shape[1] == kv_heads * group
            else mask.reshape(mask.shape[0], 1, 1, -1))
    if zeros:
        shape = (*mask.shape[:-1], zeros)
        filler = mx.zeros(shape, mx.bool_) if mask.dtype == mx.bool_ else mx.full(shape, -mx.inf, mask.dtype)
        mask = mx.concatenate([filler, mask], axis=-1)
    mask = mask.reshape(*mask.shape[:-1], blocks, chunk).swapaxes(-2, -3)
    return mx.where(mask, scores, low) if mask.dtype == mx.bool_ else scores + mask.astype(mx.float32)


def _per_query(mask: Any, heads: int) -> bool:
    """Whether a lone query's *mask* is none, "causal" (nothing, for the last position), or one row
    over the keys, shared by the heads or one per head."""
    if mask is None or isinstance(mask, str):
        return mask is None or mask == "causal"
    if mask.ndim < 4:
        return mask.ndim >= 1 and all(size == 1 for size in mask.shape[:-1])
    return mask.ndim == 4 and mask.shape[-2] == 1 and mask.shape[1] in (1, heads)
