"""A verify's matmuls a row at a time where this BLAS needs it, and its attention a query at a time.

A BLAS picks its kernel by the shape of a product: for some weight shapes the
rows of a K-row ``x @ W.T`` are not bit for bit the 1-row products classic
decode computes (OpenBLAS here: the 512 x 1024 and 64 x 1024 products of a
1024-wide Qwen 3.5, docs/blas.md), so the whole K-wide verify is inexact. The
``rows`` verify split runs the same K-wide forward with just those products
done one row at a time: exact where they were the only cause, and on a
bandwidth-bound machine nearly as cheap as the wide verify, since the other
weights are still read once (the half split reads all of them twice).

Which shapes need it is measured once per process (:func:`measure`), with the
model's own weights and random rows: a kernel's summation order does not depend
on the values, so a product that differs once differs for almost any input.

The attention is the same story one level up, and worse: mlx's CPU attention
is two batched matmuls, and in a causal block of K queries each query's sums
run over all S cached positions (the later ones masked to zero), where the
step that would have produced it sums over its own prefix. Whether the two
group their sums alike depends on S itself (3 heads of 64 over one KV head:
equal at some cache lengths, not at others, on OpenBLAS and MKL alike), so no
measurement at boot can vouch for every length. A ``rows`` verify therefore
runs attention one query at a time, as the step at that position would: under
a causal block each query over its own prefix, under a mask array (a sliding
window's ring) each over every slot with its own row of the mask, each through
the attention in place (on the CPU, :mod:`~mlxcel.models.grouped_attention`'s,
which the step goes through too). K reads of the cache instead of one, cheap
next to the weights at short contexts; at depth, docs/benchmarks.md ("The
verify's attention at depth") measures what reading it once would cost.
The exactness probe still judges the whole verify.

Scoped to one model: :func:`measure` swaps the class of just that model's layers
of the inexact shapes for a subclass that multiplies a row at a time while the
model's own :class:`RowSplit` is active, and only :func:`rows_apart` activates it.
Attention has no per-model seam in mlx-lm (every family calls
``mx.fast.scaled_dot_product_attention``), so :mod:`.attention`'s dispatcher
attends a query at a time while :func:`rows_apart` is open, and only on the
thread that measured the model, the MLX thread: :meth:`RowSplit.apart` and
:func:`.attention.one_query_at_a_time` assert it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class RowSplit:
    """One model's row-split verify: the weight shapes it multiplies a position at a time, and the flag that
    says when."""

    def __init__(self, shapes: frozenset[tuple[int, int]], share: float, max_rows: int = 0,
                 batch_shapes: frozenset[tuple[int, int]] = frozenset(), max_batch: int = 1) -> None:
        self.shapes = shapes
        """The (out, in) weight shapes whose 2..K-row products differ from 1-row ones on this BLAS."""
        self.share = share
        """Their share of the bytes of the model's float linear layers (and tied embeddings)."""
        self.max_rows = max_rows
        """Products of up to this many rows (positions) were measured."""
        self.batch_shapes = batch_shapes
        """The shapes whose product over a batch's (B, W) block differs from its W products of B rows (the
        continuous batch's classic step multiplies B rows), for B = 2..*max_batch*."""
        self.max_batch = max_batch
        self.active = False
        self._thread = threading.get_ident()

    def splits(self, shape: tuple[int, int], rows: int) -> bool:
        """Whether a product by the weight *shape* of a block of *rows* rows a position multiplies a position
        at a time."""
        return shape in (self.shapes if rows == 1 else self.batch_shapes)

    @contextmanager
    def apart(self, batch: bool = False) -> Iterator[None]:
        """While open, this model's measured layers multiply one row at a time, and attention over a cache
        (causal, or under a mask array) attends one query at a time (*batch*: a continuous batch's cache)."""
        from .attention import one_query_at_a_time

        assert threading.get_ident() == self._thread, "a rows verify runs on the MLX thread that measured it"
        with one_query_at_a_time(right_justified=batch):
            self.active = True
            try:
                yield
            finally:
                self.active = False


def measure(model: Any, max_rows: int, max_batch: int = 1) -> RowSplit:
    """The float weight shapes of *model*'s linear layers (and tied embeddings) whose products over a block of
    2..*max_rows* positions differ from the block's products a position at a time: for one row (the burst,
    against classic decode's 1-row products) and, with *max_batch* over 1, for 2..*max_batch* rows (the
    continuous batch's speculative step, against its classic step's B-row products: a BLAS picks its kernel
    by the whole product's row count, and 8 rows of 4 positions are not 4 products of 8). Measured once per
    model and batch bound: its layers of those shapes then multiply a position at a time whenever its
    :class:`RowSplit` is active."""
    import mlx.core as mx
    import mlx.nn as nn

    known: RowSplit | None = getattr(model, "row_split", None)
    if known is not None and known.max_rows >= max_rows and known.max_batch >= max_batch:
        return known
    max_batch = max(max_batch, known.max_batch if known is not None else 1)
    sizes: dict[tuple[int, int], int] = {}
    weights: dict[tuple[int, int], Any] = {}
    layers: list[Any] = []
    for _, module in model.named_modules():
        if isinstance(module, nn.Linear | nn.Embedding) and mx.issubdtype(module.weight.dtype, mx.floating):
            shape = (int(module.weight.shape[0]), int(module.weight.shape[1]))
            sizes[shape] = sizes.get(shape, 0) + module.weight.nbytes
            weights.setdefault(shape, module.weight)  # the model's own: no copy of a large head
            layers.append(module)

    def differs(weight: Any, batch: int) -> bool:
        block = mx.random.normal((batch, max_rows, weight.shape[1]), key=mx.random.key(0)).astype(weight.dtype)
        apart = mx.concatenate([block[:, i:i + 1] @ weight.T for i in range(max_rows)], axis=1)
        return any(not bool(mx.array_equal(block[:, :m] @ weight.T, apart[:, :m]).item())
                   for m in range(2, max_rows + 1))

    # One row's shapes do not depend on the batch bound: measured already (the burst's probe), they are kept.
    inexact = set(known.shapes) if known is not None and known.max_rows >= max_rows else \
        {shape for shape, weight in weights.items() if differs(weight, 1)}
    batched = {shape for shape, weight in weights.items()
               if any(differs(weight, batch) for batch in range(2, max_batch + 1))}
    total = sum(sizes.values())
    split = RowSplit(frozenset(inexact), sum(sizes[s] for s in inexact) / total if total else 0.0, max_rows,
                     frozenset(batched), max_batch)
    for layer in layers:
        if tuple(layer.weight.shape) in split.shapes | split.batch_shapes:
            if not hasattr(layer, "row_split"):
                layer.__class__ = _by_rows(type(layer))  # type: ignore[arg-type]  # classes hash
            layer.row_split = split  # a plain attribute: not a parameter, never saved
    model.row_split = split
    return split


@functools.cache
def _by_rows(cls: Any) -> type:
    """*cls* (a Linear or an Embedding) multiplying a position at a time (all of a batch's rows at once) while
    its model's RowSplit is active."""
    import mlx.nn as nn

    def by_rows(original: Any) -> Any:
        def call(self: Any, x: Any) -> Any:
            split = self.row_split
            rows = x.shape[0] if x.ndim == 3 else 1
            if not split.active or x.ndim < 2 or x.shape[-2] < 2 or not split.splits(tuple(self.weight.shape), rows):
                return original(self, x)
            import mlx.core as mx

            return mx.concatenate([original(self, x[..., i:i + 1, :]) for i in range(x.shape[-2])], axis=-2)
        return call

    name = "as_linear" if issubclass(cls, nn.Embedding) else "__call__"
    return type(f"RowSplit{cls.__name__}", (cls,), {name: by_rows(getattr(cls, name))})


@contextmanager
def rows_apart(model: Any, batch: bool = False) -> Iterator[None]:
    """:meth:`RowSplit.apart` of *model* (measured for one row shapes' set, or none: attention only); *batch*:
    over a continuous batch's cache."""
    split: RowSplit | None = getattr(model, "row_split", None)
    with (split or RowSplit(frozenset(), 0.0)).apart(batch):
        yield
