"""Which row counts of a weight's product give a row the same bytes: what :func:`.row_exact.measure` measures.

A BLAS picks its kernel, and its blocking, by the shape of a product, so a row of an n-row ``x @ W.T`` may
round otherwise than the same row alone or beside other rows. Two regularities make a row's bytes its own
at every count, each found by measurement here, shape by shape:

- **runs**: counts 1..N fall into runs that share a kernel (this project's first machines' OpenBLAS
  switched once, for small weights; MKL at 2 and at 16 rows), and within a run a row's bytes do not depend
  on the count or its place: products stay within one run, topped up or cut into pieces (:func:`kernel_class`);
- **tiles**: an optimised GEMM multiplies whole tiles of T rows with one kernel and the rows left over with
  edge kernels of their own, and within a tile a row's bytes may depend on its place. Where the first S
  places of a tile give a row the same bytes in every product of whole tiles, rows laid S to a tile (zero
  rows in the other places) keep their bytes at any count and order (:func:`tile`). OpenBLAS on an AMD EPYC
  (Zen 3, 2026-12-07): T = 12 and S = 6 for every float shape measured, where the run a lone row is in
  ends at 3 rows; cut into pieces of 3, a 16-row product took 5.5 times as long as 16 rows whole (docs/blas.md).
  The same OpenBLAS on a Zen 4 (its Cooperlake kernels) rounds no row of a large weight by its count: there
  only small shapes are padded or cut, and nothing is tiled.

The functions here multiply on the calling thread and evaluate: measurement only.
"""

from __future__ import annotations

from typing import Any

#: Of the runs of row counts that share a kernel, the padded and chunked products use the first that reaches
#: this many rows (or the widest measured): the run a lone step is in, unless that run is the lone step alone.
#: A lone step then stays as mlx multiplies it wherever it can (padding a small model's every product cost its
#: lone step a third; docs/benchmarks.md), and a wider product is cut into the fewest pieces that run allows.
WHOLE = 2
#: The widest tile looked for. A lone step pays a tile's rows (12 rows cost a 1-row product's time and a tenth to a
#: fifth on the Zen 3 machine); a wider tile would make every lone step a small batch.
MOST_TILE = 16
#: The fewest weight elements a shape's rows are laid in tiles for. Below, a product's time is its operations'
#: more than its arithmetic: a tiny model's lone step took 1.8-2.2x as long tiled (a tile's pads and slices),
#: where a step of the 1.08 GB model's weights (1-6 M elements) pays 1.2x alone and gains 2.9x at 16 rows.
TILE_ELEMENTS = 1 << 20


def whole(multiply: Any, x: Any) -> Any:
    """*multiply*(x) with no chunking, padding or tiling (a layer measured before does them otherwise)."""
    split = getattr(getattr(multiply, "__self__", multiply), "row_split", None)
    if split is None:
        return multiply(x)
    saved = split.chunks, split.pads, split.batch_shapes, split.tiles
    split.chunks, split.pads, split.batch_shapes, split.tiles = {}, {}, frozenset(), {}
    try:
        return multiply(x)
    finally:
        split.chunks, split.pads, split.batch_shapes, split.tiles = saved


def kernel_class(multiply: Any, block: Any) -> tuple[int, int] | None:
    """The counts (low, high) of *block*'s rows whose products all give each row the same bytes, wherever it
    lies: of the runs of counts 1..N that share a kernel, the first that reaches :data:`WHOLE` rows (or N);
    None where a run's kernel comes back later, or a row's bytes move with its place."""
    import mlx.core as mx

    runs: list[tuple[int, int, Any]] = []  # (low, high, the product of high rows): counts in order
    for n in range(1, len(block) + 1):
        product = whole(multiply, block[:n])
        if runs and mx.array_equal(product[:n - 1], runs[-1][2]).item():
            runs[-1] = (runs[-1][0], n, product)
            continue
        if any(mx.array_equal(product[:min(n, high)], last[:min(n, high)]).item() for _, high, last in runs[:-1]):
            return None
        runs.append((n, n, product))
    low, high, last = next((run for run in runs if run[1] >= min(len(block), WHOLE)), runs[-1])
    if high < min(len(block), WHOLE):
        return None
    return (low, high) if mx.array_equal(whole(multiply, block[:high][::-1]), last[::-1]).item() else None


def tiled(multiply: Any, rows: Any, tile: tuple[int, int]) -> Any:
    """*multiply*(*rows*) with the rows laid in *tile* (T, S): each T-row tile holds S of them in its first S
    places and zero rows in the rest, as many tiles as they fill. (Few operations: on a small model each one
    costs about what the product does.)"""
    import mlx.core as mx

    size, slots = tile
    count = rows.shape[0]
    if count <= slots:  # one tile: the rows, then zero rows
        return multiply(mx.pad(rows, [(0, size - count), (0, 0)]))[:count]
    tiles = -(-count // slots)
    laid = mx.pad(rows, [(0, tiles * slots - count), (0, 0)]).reshape(tiles, slots, -1)
    out = multiply(mx.pad(laid, [(0, 0), (0, size - slots), (0, 0)]).reshape(tiles * size, -1))
    return out.reshape(tiles, size, -1)[:, :slots].reshape(tiles * slots, -1)[:count]


def tile(multiply: Any, block: Any) -> tuple[int, int] | None:
    """A layout (T, S) of rows in tiles (:func:`tiled`) in which every product of 1..N of *block*'s N rows gives
    each row the bytes it has in the product of all N, wherever it lies: of the tiles of T rows (2..
    :data:`MOST_TILE`) whose products agree at T and 2T rows, the one whose first places that give a row one
    kernel's bytes hold the largest share of it (OpenBLAS on the Zen 3: T = 12, S = 6: a tile's second six
    places round otherwise); None where none does."""
    import mlx.core as mx

    def alone(rows: Any) -> Any:
        return whole(multiply, rows)

    found: list[tuple[float, int, int]] = []
    for size in range(2, min(MOST_TILE, len(block)) + 1):
        if len(block) < 2 * size or not mx.array_equal(alone(block[:size]), alone(block[:2 * size])[:size]).item():
            continue
        # A row's bytes at each place of the tile: the places before the first that rounds otherwise are its slots.
        first = alone(block[:size])[0]
        slots = next((p for p in range(1, size) if not mx.array_equal(
            alone(mx.concatenate([block[1:p + 1], block[:1], block[p + 1:size]]))[p], first).item()), size)
        layout = (size, slots)
        every = tiled(alone, block, layout)
        if all(mx.array_equal(tiled(alone, block[:n], layout), every[:n]).item() for n in range(1, len(block))) \
                and mx.array_equal(tiled(alone, block[::-1], layout), every[::-1]).item():
            found.append((slots / size, -size, slots))  # the largest share first, then the smallest tile
    if not found:
        return None
    _, smaller, slots = max(found)
    return -smaller, slots


def positions_differ(multiply: Any, block: Any, rows: int, positions: int) -> bool:
    """Whether a (rows, positions) block's product differs from its products a position at a time (all rows
    together), for some block of 2..*positions* positions."""
    import mlx.core as mx

    shaped = block[:rows * positions].reshape(rows, positions, -1)
    apart = mx.concatenate([whole(multiply, shaped[:, i:i + 1]) for i in range(positions)], axis=1)
    return any(not mx.array_equal(whole(multiply, shaped[:, :m]), apart[:, :m]).item()
               for m in range(2, positions + 1))
