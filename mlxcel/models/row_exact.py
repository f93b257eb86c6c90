"""Products that give every row the same bytes, whatever else shares the product; a verify's attention a
query at a time.

A BLAS picks its kernel by the shape of a product: for some weight shapes the
rows of an N-row ``x @ W.T`` are not bit for bit the 1-row products classic
decode computes (OpenBLAS here: 512 x 1024 from 2 rows, 128 x 1024 from 8,
64 x 1024 from 16, docs/blas.md). Two things then break:

- a K-wide verify is not the K classic steps it must equal (the burst's
  exactness), and a batch's (B, K) verify is not its B-row classic steps;
- a request's decode steps round with the *width* of the batch around it, so
  its text can depend on who else was served, and with speculation on or off
  (rows finish earlier, the batch narrows at other steps) two runs of the same
  arrivals can part at a near-tie.

So, once per model, :func:`measure` finds for each float weight shape how its
products may be made to give each row the same bytes at every count up to the
widest block the server runs (``max_rows`` positions a row, ``max_batch``
rows), with the model's own layers and random rows: a kernel's summation order
does not depend on the values, so a product that differs once differs for
almost any input. Two regularities (:mod:`.row_kernels`, which measures them):
the row counts 1..N fall into *runs* that share a kernel (this project's first
machines' OpenBLAS switched once, for small weights; MKL twice, at 2 rows and
at 16), or a GEMM multiplies whole *tiles* of T rows alike and only the rows
left over otherwise (OpenBLAS on a Zen 3: T = 12, every shape; there the run
a lone row is in ends at 3 rows). On the CPU backend, on the MLX thread:

- a shape whose run reaches every count needs nothing, or only a product of
  fewer rows than its run's first count *padded* (topped up with zero rows);
- else, for a weight of :data:`~.row_kernels.TILE_ELEMENTS` or more where a
  tile of at most :data:`~.row_kernels.MOST_TILE` rows is found, every step's
  and verify's product is *tiled*: its rows laid S to a tile of T rows (the
  other places zero rows), one product however wide (a lone step pays a
  whole tile);
- else each product keeps to the first run that reaches
  :data:`~.row_kernels.WHOLE` rows (a lone step's own, unless it holds one
  count only), padded to its first count and *chunked* into pieces within it;
  a shape whose runs do not behave so (a kernel coming back) is chunked to the
  most rows that give each row its one-row bytes.

Every product of every step, verify and width then gives a row the same bytes.
Chunks and tiles apply in two places:

- every step that feeds one position a row (a batch's classic step; a lone
  request's, one row, is already whole for a chunked shape, and laid in a
  tile for a tiled one), so a row's step is the same bytes at any batch width;
- every block of positions inside :func:`rows_apart` (the ``rows`` verify).

Chunked, a (B, K) verify of a 2 MB weight costs B x K one-row products where
one product would do (32 of them: 2.8 ms against 0.5, docs/benchmarks.md); the
padding costs a lone step's product of such a weight a second row (0.17 ->
0.33 ms). Prefill chunks of chunked shapes are left whole: they are not steps,
and a prompt's chunks are the same in every run.

The attention is the same story one level up: mlx's CPU attention over a causal
block of K queries sums over all S cached positions (the later ones masked),
where the step that would have produced each query sums over its own prefix. A
``rows`` verify therefore runs attention one query at a time, as the step at
that position would: under a causal block each query over its own prefix, under
a mask array (a sliding window's ring) each over every slot with its own row of
the mask, each through the attention in place (on the CPU,
:mod:`~mlxcel.models.grouped_attention`'s, which every step goes through too).
The exactness probe still judges the whole verify.

Scoped to one model: :func:`measure` swaps the class of just that model's layers
of the padded or chunked shapes for a subclass that pads or chunks, and attention
has no per-model seam in mlx-lm (every family calls
``mx.fast.scaled_dot_product_attention``), so :mod:`.attention`'s dispatcher
attends a query at a time while :func:`rows_apart` is open, and only on the
MLX thread: :meth:`RowSplit.apart` and :func:`.attention.one_query_at_a_time`
assert it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from .attention import on_mlx_thread, one_query_at_a_time
from .row_kernels import MOST_TILE, TILE_ELEMENTS, kernel_class, positions_differ, tile, tiled, whole


class RowSplit:
    """One model's padded and chunked products, by weight shape; and the flag that says a ``rows`` verify is
    open."""

    def __init__(self, chunks: Mapping[tuple[int, int], int], share: float, max_rows: int = 0,
                 max_batch: int = 1, steps: bool = True,
                 batch_shapes: frozenset[tuple[int, int]] = frozenset(),
                 pads: Mapping[tuple[int, int], int] | None = None,
                 tiles: Mapping[tuple[int, int], tuple[int, int]] | None = None) -> None:
        self.chunks = dict(chunks)
        """(out, in) weight shape -> the most rows a step's or a verify's product takes at once (1..N-1, N =
        *max_rows* x *max_batch*): the end of the shape's run of counts that share a kernel (with :attr:`pads`),
        or the most that give each row its 1-row bytes. A shape in neither is exact at every count measured."""
        self.tiles = dict(tiles or {})
        """(out, in) weight shape -> (T, S): on the MLX thread a step's or a verify's product lays its rows S to a
        tile of T rows (:func:`~.row_kernels.tiled`). A shape here is in neither :attr:`chunks` nor :attr:`pads`."""
        self.pads = dict(pads or {})
        """(out, in) weight shape -> the first count of the shape's run: on the MLX thread a product (or a
        chunk) of fewer rows is topped up to this many."""
        self.share = share
        """The share of the bytes of the model's float linear layers (and tied embeddings) whose products of
        2..*max_rows* positions of one row are chunked: what a lone request's verify reads more than once."""
        self.max_rows = max_rows
        """Positions a row: products of blocks of up to this many were measured."""
        self.max_batch = max_batch
        """Rows of a batch: ... of up to this many rows of those."""
        self.steps = steps
        """Whether one-position steps of several rows are chunked too (the CPU backend, where it costs
        nothing measurable). Elsewhere a batch's steps stay whole, so its verify multiplies a block a position
        at a time, all rows together, for :attr:`batch_shapes`: equal to those steps, not to one row's."""
        self.batch_shapes = batch_shapes
        """Without :attr:`steps`: the shapes whose product over a (B, W) block differs from its W products of
        B rows, for B = 2..*max_batch*."""
        self.active = False
        self._thread = threading.get_ident()

    @property
    def shapes(self) -> frozenset[tuple[int, int]]:
        """The shapes a lone request's verify (2..*max_rows* positions of one row) multiplies in chunks."""
        return frozenset(shape for shape, most in self.chunks.items() if most < self.max_rows)

    def chunk(self, shape: tuple[int, int], rows: int, positions: int) -> int | None:
        """How many rows at a time a product by *shape* of *rows* rows (*positions* a sequence) multiplies, or
        None for all at once."""
        most = self.chunks.get(shape)
        if most is None or rows <= most or not (self.active or (positions == 1 and self.steps)) \
                or not on_mlx_thread():
            return None
        return most

    def tile(self, shape: tuple[int, int], positions: int) -> tuple[int, int] | None:
        """The tile (T, S) a product by *shape* (*positions* a sequence) lays its rows in, or None: a step or a
        verify's block on the MLX thread, as :meth:`chunk`."""
        size = self.tiles.get(shape)
        if size is None or not (self.active or (positions == 1 and self.steps)) or not on_mlx_thread():
            return None
        return size

    @contextmanager
    def apart(self, batch: bool = False) -> Iterator[None]:
        """While open, this model's chunked layers chunk blocks of positions too, and attention over a cache
        (causal, or under a mask array) attends one query at a time (*batch*: a continuous batch's cache)."""
        assert threading.get_ident() == self._thread, "a rows verify runs on the MLX thread that measured it"
        with one_query_at_a_time(right_justified=batch):
            self.active = True
            try:
                yield
            finally:
                self.active = False


def measure(model: Any, max_rows: int, max_batch: int = 1) -> RowSplit:
    """Which float weight shapes of *model*'s linear layers (and tied embeddings) give a row other bytes in a
    product of 2..N rows (N = *max_rows* x *max_batch*: a verify's positions times the batch's rows, or a
    classic step's rows) than alone, and in chunks of how many they do not. Measured through each shape's
    layer on flat (n, in) blocks: mlx multiplies a (rows, positions, in) block as one product of rows x
    positions rows. Measured once per model and bounds; its layers of those shapes then multiply in chunks
    (see the module docstring)."""
    import mlx.core as mx
    import mlx.nn as nn

    known: RowSplit | None = getattr(model, "row_split", None)
    if known is not None and known.max_rows >= max_rows and known.max_batch >= max_batch:
        return known
    if known is not None:
        max_rows, max_batch = max(max_rows, known.max_rows), max(max_batch, known.max_batch)
    sizes: dict[tuple[int, int], int] = {}
    samples: dict[tuple[int, int], Any] = {}
    for _, module in model.named_modules():
        if isinstance(module, nn.Linear | nn.Embedding) and mx.issubdtype(module.weight.dtype, mx.floating):
            shape = (int(module.weight.shape[0]), int(module.weight.shape[1]))
            sizes[shape] = sizes.get(shape, 0) + module.weight.nbytes
            if _plain(module):
                samples.setdefault(shape, module)  # the model's own: no copy of a large head
    most = max_rows * max_batch
    steps = mx.default_device() == mx.cpu
    chunks, pads, tiles, batched = {}, {}, {}, set()
    for shape, layer in samples.items():
        multiply = layer.as_linear if isinstance(layer, nn.Embedding) else layer
        block = mx.random.normal((most, shape[1]), key=mx.random.key(0)).astype(layer.weight.dtype)
        kept = kernel_class(multiply, block) if steps else None
        # Rows laid in tiles, one product, where a run would cut the widest product into pieces: on the Zen 3
        # machine 16 rows in one product took a fifth of the time of 16 in pieces of 3 (docs/blas.md).
        layout = None
        if steps and (kept is None or kept[1] < most) and shape[0] * shape[1] >= TILE_ELEMENTS:
            rows = max(most, 2 * MOST_TILE)  # tiles of every size up to MOST_TILE, twice over
            layout = tile(multiply, mx.random.normal((rows, shape[1]), key=mx.random.key(0)).astype(block.dtype))
        if layout is not None:
            tiles[shape] = layout
        elif kept is not None:  # padded up to low rows, cut to high rows at most
            low, high = kept
            if low > 1:
                pads[shape] = low
            if high < most:
                chunks[shape] = high
        else:  # each row its one-row bytes: chunks of the most rows that give them
            alone = mx.concatenate([whole(multiply, block[i:i + 1]) for i in range(most if steps else max_rows)])
            fits = next((n - 1 for n in range(2, len(alone) + 1)
                         if not mx.array_equal(whole(multiply, block[:n]), alone[:n]).item()), most)
            if fits < len(alone):
                chunks[shape] = fits
        if not steps and any(positions_differ(multiply, block, rows, max_rows) for rows in range(2, max_batch + 1)):
            batched.add(shape)
    total = sum(sizes.values())
    split = RowSplit(chunks, 0.0, max_rows, max_batch, steps, frozenset(batched), pads, tiles)
    split.share = sum(sizes[s] for s in split.shapes) / total if total else 0.0
    return adopt(model, split)


def adopt(model: Any, split: RowSplit) -> RowSplit:
    """Make *model*'s layers of *split*'s shapes pad or chunk as it says: a split :func:`measure` found, or one
    an earlier start on this machine found for this model, kept with the exactness probes' outcomes
    (:mod:`mlxcel.engine.probe_memo`)."""
    import mlx.core as mx
    import mlx.nn as nn

    layers = [module for _, module in model.named_modules()
              if isinstance(module, nn.Linear | nn.Embedding) and mx.issubdtype(module.weight.dtype, mx.floating)
              and _plain(module)]
    shapes = split.chunks.keys() | split.pads.keys() | split.tiles.keys() | split.batch_shapes
    for layer in layers:
        if tuple(layer.weight.shape) in shapes:
            if not hasattr(layer, "row_split"):
                layer.__class__ = _by_rows(type(layer))  # type: ignore[arg-type]  # classes hash
            layer.row_split = split  # a plain attribute: not a parameter, never saved
        elif hasattr(layer, "row_split"):
            layer.row_split = split  # measured again: its shape needs no chunks now
    if split.steps:
        _flatten_pairs(model)
    model.row_split = split
    return split


def _flatten_pairs(model: Any) -> None:
    """Give *model*'s float gathered experts (mlx-lm's ``SwitchLinear``: an MoE's expert products) a
    (token, expert) pair's bytes in every product on the MLX thread.

    mlx-lm's ``SwitchGLU`` sorts the pairs by expert once they are 64 or more (a batch's step of 16 rows at
    top 4, a verify) and multiplies each as a flat row; fewer (a lone step, a narrow batch) it multiplies
    broadcast, a token against its experts, and there this OpenBLAS rounds otherwise for weights up to
    1024 x 512 (not at 2048 x 512, 2048 x 768 or 2048 x 1536, the released Qwen and GLM MoE shapes:
    docs/mtp.md). So a row's step was not its bytes alone, and a verify not its steps. Here the broadcast
    call is made flat too: every pair is multiplied as the sorted path multiplies it. Quantized experts
    (``gather_qmm``) round alike on both paths and are left alone."""
    from mlx_lm.models.switch_layers import SwitchLinear

    for _, module in model.named_modules():
        if type(module) is SwitchLinear:
            module.__class__ = _flat_pairs()


@functools.cache
def _flat_pairs() -> type:
    """mlx-lm's ``SwitchLinear`` multiplying every (token, expert) pair as a flat row on the MLX thread."""
    import mlx.core as mx
    from mlx_lm.models.switch_layers import SwitchLinear

    def call(self: Any, x: Any, indices: Any, sorted_indices: bool = False) -> Any:
        if sorted_indices or not on_mlx_thread() or x.shape[-2] != 1:
            return SwitchLinear.__call__(self, x, indices, sorted_indices=sorted_indices)
        pairs = indices.size  # x: a token against its experts (broadcast), or a pair a row already
        flat = mx.broadcast_to(x, (*indices.shape, 1, x.shape[-1])).reshape(pairs, 1, x.shape[-1])
        out = SwitchLinear.__call__(self, flat, indices.reshape(pairs), sorted_indices=False)
        return out.reshape(*indices.shape, 1, out.shape[-1])

    return type("FlatPairsSwitchLinear", (SwitchLinear,), {"__call__": call})


def _plain(layer: Any) -> bool:
    """Whether *layer* multiplies as mlx's own Linear (or Embedding, as a linear layer) does: one array out, so
    its product may be padded or chunked. A family's own subclass that returns something else (afm7's fused
    projections return their parts) is left alone."""
    import mlx.nn as nn

    cls = type(layer).__mro__[1] if hasattr(layer, "row_split") else type(layer)  # measured before: its own class
    if isinstance(layer, nn.Embedding):
        return bool(getattr(cls, "as_linear", None) is nn.Embedding.as_linear)
    return bool(cls.__call__ is nn.Linear.__call__)


def _topped_up(multiply: Any, layer: Any, rows: Any, low: int) -> Any:
    """*multiply*(*layer*, *rows*), the rows topped up with zero rows to *low* (the product's kernel switch)."""
    import mlx.core as mx

    if len(rows) >= low:
        return multiply(layer, rows)
    return multiply(layer, mx.concatenate([rows, mx.zeros((low - len(rows), rows.shape[-1]), rows.dtype)]))[:len(rows)]


@functools.cache
def _by_rows(cls: Any) -> type:
    """*cls* (a Linear or an Embedding) multiplying in its model's chunks, where :meth:`RowSplit.chunk` says."""
    import mlx.nn as nn

    def by_rows(original: Any) -> Any:
        def call(self: Any, x: Any) -> Any:
            import mlx.core as mx

            split, shape = self.row_split, tuple(self.weight.shape)
            if not on_mlx_thread():
                return original(self, x)
            rows = 1
            for size in x.shape[:-1]:
                rows *= size
            most = None
            if x.ndim >= 2:
                positions = x.shape[-2] if x.ndim >= 3 else x.shape[0]  # flat rows: a block, not a batch's step
                if split.steps or rows == positions:
                    layout = split.tile(shape, positions)
                    if layout is not None:
                        out = tiled(functools.partial(original, self), x.reshape(rows, x.shape[-1]), layout)
                        return out.reshape(*x.shape[:-1], out.shape[-1])
                    most = split.chunk(shape, rows, positions)
                elif split.active and positions > 1 and shape in split.batch_shapes:
                    return mx.concatenate([original(self, x[..., i:i + 1, :]) for i in range(positions)], axis=-2)
            low = split.pads.get(shape, 1)
            if most is None and rows >= low:
                return original(self, x)
            flat = x.reshape(rows, x.shape[-1])
            pieces = [flat[i:i + most] for i in range(0, rows, most)] if most else [flat]
            out = mx.concatenate([_topped_up(original, self, piece, low) for piece in pieces])
            return out.reshape(*x.shape[:-1], out.shape[-1])
        return call

    name = "as_linear" if issubclass(cls, nn.Embedding) else "__call__"
    return type(f"RowSplit{cls.__name__}", (cls,), {name: by_rows(getattr(cls, name))})


def measure_steps(model: Any, widest: int, positions: int = 1) -> RowSplit | None:
    """On the CPU backend, :func:`measure` *model* for steps of up to *widest* rows and verifies of up to
    *positions* a row (a no-op where as much was measured already), so that a row's products are its bytes
    alone at any width; elsewhere nothing (see :attr:`RowSplit.steps`)."""
    import mlx.core as mx

    if positions * widest < 2 or mx.default_device() != mx.cpu:  # one row only: nothing shares a product
        return None
    return measure(model, positions, max_batch=widest)


@contextmanager
def rows_apart(model: Any, batch: bool = False) -> Iterator[None]:
    """:meth:`RowSplit.apart` of *model* (measured, or not: attention only); *batch*: over a continuous
    batch's cache."""
    split: RowSplit | None = getattr(model, "row_split", None)
    with (split or RowSplit({}, 0.0)).apart(batch):
        yield
