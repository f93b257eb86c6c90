"""Rows joining and leaving the batch: mlx-lm's ``extend`` and ``filter`` against ``mlxcel.models.batch_rows``.

    python -m benchmarks.batch_rows [--rows 2] [--joining 7] [--keys 2048] [--leaving 1] [--repeats 5]

Layers shaped as Qwen3.5-0.8B's (the ``--released`` pairing of ``benchmarks/batch_mtp.py``, 12 layers):
three full-attention layers of 2 KV heads of 256 (fp32) and nine gated-delta layers (a convolution state of
3 x 6144 and a recurrent state of 16 x 128 x 128 a row). A batch of *rows* rows over *keys* tokens of context,
and *joining* prompts of as many tokens, each prefilled alone (a batch of one row), join it:

- one at a time: ``layer.extend(part)`` for each part, as the batch did before (each call copies the whole
  batch's arrays);
- at once: ``mlxcel.models.batch_rows.join_layers`` (each layer's arrays concatenated once).

Then *leaving* rows of a batch of 16 leave it (every row left-padded by a few positions, as a batch that speculated
leaves them), and the next step writes one position a row into every attention layer:

- mlx-lm's ``filter`` (a gather of the whole buffer, then a view past the padding the rows share; the write copies
  the view whole);
- ``mlxcel.models.batch_rows.filter_layer`` (the kept rows past that padding copied once, then written in place).

Prints the best of *repeats* seconds of each and the ratio.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import ArraysCache, BatchKVCache  # noqa: E402

from benchmarks._common import best_of  # noqa: E402
from mlxcel.models.batch_rows import filter_layer, join_layers  # noqa: E402

ATTENTION_LAYERS, MIXER_LAYERS = 3, 9


def arrays(layer: Any) -> list[mx.array]:
    if isinstance(layer, BatchKVCache):
        return [layer.keys, layer.values, layer.offset, layer.left_padding]
    return [array for array in layer.cache if array is not None]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=2, help="rows in the batch")
    parser.add_argument("--joining", type=int, default=7, help="prompts that join it in the step")
    parser.add_argument("--keys", type=int, default=2048, help="tokens of context of every row")
    parser.add_argument("--leaving", type=int, default=1, help="rows of 16 that leave")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    def attention(rows: int, keys: int) -> BatchKVCache:
        layer = BatchKVCache([0] * rows)
        layer.update_and_fetch(mx.random.normal((rows, 2, keys, 256)), mx.random.normal((rows, 2, keys, 256)))
        return layer

    def mixer(rows: int) -> ArraysCache:
        layer = ArraysCache(2)
        layer.cache = [mx.random.normal((rows, 3, 6144)), mx.random.normal((rows, 16, 128, 128))]
        return layer

    def parts() -> list[list[Any]]:
        """Per layer: the batch's, then each joining prompt's (a few tokens shorter: the rows decoded on)."""
        out = [[attention(args.rows, args.keys + 16), *(attention(1, args.keys) for _ in range(args.joining))]
               for _ in range(ATTENTION_LAYERS)]
        out += [[mixer(args.rows), *(mixer(1) for _ in range(args.joining))] for _ in range(MIXER_LAYERS)]
        mx.eval([arrays(layer) for layers in out for layer in layers])
        return out

    def one_at_a_time(layers: list[list[Any]]) -> list[Any]:
        for first, *rest in layers:
            for part in rest:
                first.extend(part)
        return [arrays(first) for first, *_ in layers]

    def at_once(layers: list[list[Any]]) -> list[Any]:
        return [arrays(join_layers(parts)) for parts in layers]

    print(f"{args.rows} rows over {args.keys} keys, {args.joining} prompts joining")
    a, b = best_of(parts, one_at_a_time, args.repeats), best_of(parts, at_once, args.repeats)
    print(f"one at a time {a:.4f} s, at once {b:.4f} s, ratio {a / b:.1f}x")

    keep = list(range(args.leaving, 16))

    def batch() -> list[BatchKVCache]:
        out = [attention(16, args.keys) for _ in range(ATTENTION_LAYERS)]
        for layer in out:
            layer.left_padding = mx.array([3 + i % 5 for i in range(16)])  # the rows' rejected drafts, rotated
        mx.eval([arrays(layer) for layer in out])
        return out

    def left(leave: Callable[[BatchKVCache], None]) -> Callable[[list[BatchKVCache]], list[Any]]:
        def run(layers: list[BatchKVCache]) -> list[Any]:
            for layer in layers:
                leave(layer)
                step = mx.random.normal((len(keep), 2, 1, 256))
                layer.update_and_fetch(step, step)
            return [arrays(layer) for layer in layers]
        return run

    print(f"16 rows over {args.keys} keys, {args.leaving} leaving, then a step's write")
    a = best_of(batch, left(lambda layer: layer.filter(keep)), args.repeats)
    b = best_of(batch, left(lambda layer: filter_layer(layer, keep)), args.repeats)
    print(f"mlx-lm's filter {a:.4f} s, ours {b:.4f} s, ratio {a / b:.1f}x")


if __name__ == "__main__":
    main()
