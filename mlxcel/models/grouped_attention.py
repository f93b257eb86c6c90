"""One query's attention over a deep cache, its query heads grouped by the KV head they share (CPU backend).

mlx's CPU ``scaled_dot_product_attention`` is composed of ops: for a
grouped-query model it broadcasts each KV head to its query heads and runs one
matrix-vector product per *query* head, and the BLAS packs that head's whole
key (and value) cache for each. Past a few thousand cached positions the packing
is the step's attention: 10.6 ms a layer at 8k keys for 8 query heads over 2
KV heads of 128, where putting the query heads that share a KV head into the
rows of one product reads each KV cache once, 4.9 ms (docs/benchmarks.md,
"Decode at depth: the query heads grouped"). The sums are the same sums,
grouped by the same BLAS, so the difference is rounding (1e-7 of values of
order one).

Only where it pays, and where it cannot change which text a model writes
against mlx-lm's own decode at the short contexts its tests and ours compare:
one query (a decode step, a drafter's draft, a ``rows`` verify's query, a
batch's step), no attention sinks, more query heads than KV heads, and at
least :data:`GROUPED_FROM` keys. A mask array (a batch's left padding, a
sliding window's ring) is applied as mlx applies it. A verify's queries that
attend one at a time go through the same rule at the same depth as the
classic step they must equal, so the exactness probe's guarantee is unchanged
(its 1,024 offset reaches it).

The rule is applied where mlx-lm's families call attention, by the dispatcher
:mod:`.attention` installs, on the MLX thread only. The functions here are pure
functions of their arrays.
"""

from __future__ import annotations

from typing import Any

#: Fewest cached keys at which a lone query attends grouped. Below it mlx's own kernel keeps its bytes
#: (and mlx-lm's texts) and costs under a millisecond a layer either way.
GROUPED_FROM = 1024


def grouped_over(attention: Any) -> Any:
    """*attention* (mlx's signature), with a lone query over :data:`GROUPED_FROM` or more keys of fewer
    KV heads than query heads computed grouped."""
    def scaled_dot_product_attention(q: Any, k: Any, v: Any, *, scale: float, mask: Any = None,
                                     sinks: Any = None, **kwargs: Any) -> Any:
        if (q.shape[2] == 1 and sinks is None and not kwargs and q.shape[1] > k.shape[1]
                and k.shape[2] >= GROUPED_FROM and _per_query(mask, q.shape[1])):
            # A lone query is the last position: "causal" masks nothing.
            return grouped(q, k, v, scale, None if isinstance(mask, str) else mask)
        if sinks is not None:
            kwargs["sinks"] = sinks
        return attention(q, k, v, scale=scale, mask=mask, **kwargs)

    return scaled_dot_product_attention


def grouped(q: Any, k: Any, v: Any, scale: float, mask: Any = None) -> Any:
    """Attention of one query *q* (B, H, 1, D) over *k*, *v* (B, KV, S, D), the H / KV query heads of
    each KV head in the rows of one product. *mask*: None, or an array over the keys (boolean: where
    to attend; else added to the scores) whose head axis, if any, is 1 or H. Softmax in float32, and a
    boolean mask's excluded scores at the dtype's lowest, as mlx's own."""
    import mlx.core as mx

    batch, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    rows = (q * mx.array(scale, q.dtype)).reshape(batch, kv_heads, heads // kv_heads, dim)
    scores = rows @ k.swapaxes(-1, -2)
    if mask is not None:
        if mask.ndim == 4 and mask.shape[1] == heads:
            mask = mask.reshape(mask.shape[0], kv_heads, heads // kv_heads, mask.shape[-1])
        scores = (mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
                  if mask.dtype == mx.bool_ else scores + mask)
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ v).reshape(batch, heads, 1, v.shape[-1])


def _per_query(mask: Any, heads: int) -> bool:
    """Whether a lone query's *mask* is none, "causal" (nothing, for the last position), or one row
    over the keys, shared by the heads or one per head."""
    if mask is None or isinstance(mask, str):
        return mask is None or mask == "causal"
    if mask.ndim < 4:
        return mask.ndim >= 1 and all(size == 1 for size in mask.shape[:-1])
    return mask.ndim == 4 and mask.shape[-2] == 1 and mask.shape[1] in (1, heads)
