"""A batch's rollback when its rows kept different numbers of drafts: mlx-lm's way against ours, side by side.

    python -m benchmarks.batch_rollback [--rows 16] [--keys 2048] [--moving 1] [--repeats 5]

Layers shaped as Qwen3.5-0.8B's (the ``--released`` pairing of ``benchmarks/batch_mtp.py``, 12 layers):
three full-attention layers of 2 KV heads of 256 (fp32) and nine gated-delta layers of 16 value heads of
128 x 128 state, K = 3 (four states kept per verify). *moving* rows rejected one draft more than the others
(a request reaching ``max_tokens``; every step where the rows' drafts do not agree alike):

- attention: mlx-lm's ``prepare(right_padding)``/``finalize`` (a ``dynamic_roll`` of every row) against
  ``mlxcel.models.batch_rollback.rollback_kv_rows`` (the rows that move, rotated, written in place);
- gated-delta: every token's state stacked, then one taken per row, against each row's own state;
- attention again, every row holding a position of left padding (an earlier rollback's): trimmed at what the
  fewest rows rejected, the others rotated back (as before 2026-12-07), against trimmed so that the fewest rows
  move (with ``--moving 15``, one row moves forward instead of fifteen back).

Prints the best of *repeats* seconds of each and the ratio.
"""

from __future__ import annotations

import argparse
from typing import Any

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import BatchKVCache  # noqa: E402

from benchmarks._common import best_of  # noqa: E402
from mlxcel.models.batch_rollback import rollback_kv_rows, rotate_rows  # noqa: E402

ATTENTION_LAYERS, MIXER_LAYERS, WIDTH = 3, 9, 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--keys", type=int, default=2048)
    parser.add_argument("--moving", type=int, default=1, help="rows that reject one draft more than the rest")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = args.rows
    rejected = [1] * args.moving + [0] * (rows - args.moving)

    def layers(padding: int = 0) -> list[BatchKVCache]:
        out = []
        for _ in range(ATTENTION_LAYERS):
            layer = BatchKVCache([padding] * rows)
            keys = mx.random.normal((rows, 2, args.keys, 256))
            layer.update_and_fetch(keys, mx.random.normal(keys.shape))
            mx.eval(layer.keys, layer.values)
            out.append(layer)
        return out

    def mlx_lms(cache: list[BatchKVCache]) -> list[Any]:
        for layer in cache:
            layer.prepare(right_padding=rejected)
            layer.finalize()
        return [layer.state[:4] for layer in cache]

    def ours(cache: list[BatchKVCache]) -> list[Any]:
        rollback_kv_rows(cache, rejected)
        return [layer.state[:4] for layer in cache]

    def least_trimmed(cache: list[BatchKVCache]) -> list[Any]:
        common = min(rejected)
        for layer in cache:
            layer.trim(common)
        rotate_rows(cache, [r - common for r in rejected])
        return [layer.state[:4] for layer in cache]

    def states() -> list[list[mx.array]]:
        out = [[mx.random.normal((rows, 16, 128, 128)) for _ in range(WIDTH)] for _ in range(MIXER_LAYERS)]
        mx.eval(out)
        return out

    last = [WIDTH - 1 - r for r in rejected]

    def stacked(kept: list[list[mx.array]]) -> list[mx.array]:
        pick = mx.array(last).reshape(-1, 1, 1, 1, 1)
        return [mx.take_along_axis(mx.stack(s, axis=1), pick, axis=1).squeeze(1) for s in kept]

    def by_row(kept: list[list[mx.array]]) -> list[mx.array]:
        return [mx.concatenate([s[j][i:i + 1] for i, j in enumerate(last)], axis=0) for s in kept]

    print(f"{rows} rows, {args.keys} keys, {args.moving} rejecting one more draft than the others")
    for name, setup, theirs, mine in (("attention (3 layers)", layers, mlx_lms, ours),
                                      ("gated-delta (9 layers)", states, stacked, by_row)):
        a, b = best_of(setup, theirs, args.repeats), best_of(setup, mine, args.repeats)
        print(f"{name:>24}: mlx-lm's way {a:.4f} s, ours {b:.4f} s, ratio {a / b:.1f}x")
    a, b = (best_of(lambda: layers(padding=1), way, args.repeats) for way in (least_trimmed, ours))
    print(f"{'attention, padded rows':>24}: the least trimmed {a:.4f} s, the fewest moving {b:.4f} s, "
          f"ratio {a / b:.1f}x")


if __name__ == "__main__":
    main()
