"""A batch's drafter catching up on the positions its rows decoded classically: every position read whole
against all but each row's last written as keys and values alone (``remember``), side by side.

    python -m benchmarks.drafter_catch_up [--rows 16] [--depth 8192] [--positions 64] [--passes 4]

The ``--released`` pairing's head (``benchmarks/batch_mtp.py``: Qwen3.5-0.8B's layer shapes, one
full-attention layer of 8 query heads over 2 KV heads of 256, fp32), each row's head cache holding *depth*
positions already (random keys and values: what is timed reads them, whatever they hold), then *positions*
queued a row (the 64 classic steps after which a parked batch's drafters read what they queued, or a
speculative step's kept positions with ``--positions 4``). Prints the median seconds of each and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace
from typing import Any

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import mlx.core as mx  # noqa: E402

from benchmarks._common import context_window, mtp_model  # noqa: E402


class _Whole:
    """The head without ``remember``: every queued position read whole (the build before it)."""

    def __init__(self, head: Any) -> None:
        self._head = head

    def __call__(self, embeddings: Any, hidden: Any, cache: list[Any]) -> Any:
        return self._head(embeddings, hidden, cache)

    def make_cache(self) -> list[Any]:
        return list(self._head.make_cache())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--depth", type=int, default=8192)
    parser.add_argument("--positions", type=int, default=64)
    parser.add_argument("--passes", type=int, default=4)
    args = parser.parse_args()

    from mlx_lm import load

    from mlxcel.checkpoints import inspect_checkpoint, inspect_drafter, load_drafter
    from mlxcel.models.attention import mlx_thread
    from mlxcel.models.drafters.own_cache import OwnCacheBatch, OwnCacheSequence

    path = mtp_model("aligned", 0.0, 12, 1024, context_window(args.depth, 4096), True)
    with mlx_thread():
        info = inspect_checkpoint(path)
        model, _ = load(str(path))
        drafter = load_drafter(inspect_drafter(info, mtp=True, draft_model=None), info, model)
        sides = {"whole": SimpleNamespace(head=_Whole(drafter.head), embed=drafter.embed, lm_head=drafter.lm_head),
                 "remember": drafter}
        layer = drafter.head.layers[0].self_attn
        shape = (1, layer.num_key_value_heads, args.depth, layer.head_dim)
        hidden_size = drafter.head.fc.weight.shape[0]

        def batch(side: Any) -> OwnCacheBatch:
            """*rows* rows whose head caches hold *depth* positions, merged (one position read each)."""
            drafts = OwnCacheBatch(side)
            for uid in range(args.rows):
                sequence = OwnCacheSequence(side)
                for cache in sequence._cache:
                    cache.keys, cache.values = mx.random.normal(shape) * 0.1, mx.random.normal(shape) * 0.1
                    cache.offset = args.depth
                drafts.join(uid, sequence)
                drafts.catch_up(uid, mx.random.normal((1, 1, hidden_size)), mx.array([[uid]]))
            mx.eval(drafts.settle(list(range(args.rows))))
            return drafts

        times: dict[str, list[float]] = {side: [] for side in sides}
        for _ in range(args.passes):
            for name, side in sides.items():
                drafts = batch(side)
                queued = [(mx.random.normal((1, args.positions, hidden_size)),
                           mx.random.randint(0, 500, (1, args.positions))) for _ in range(args.rows)]
                mx.eval(queued)  # made before the clock starts: only the catch-up is timed
                for uid, (hidden, tokens) in enumerate(queued):
                    drafts.catch_up(uid, hidden, tokens)
                started = time.perf_counter()
                mx.eval(drafts.settle(list(range(args.rows))))
                times[name].append(time.perf_counter() - started)
                del drafts
    whole, remember = (statistics.median(times[side]) for side in sides)
    print(f"model: {path.name}, {args.rows} rows over {args.depth} keys, {args.positions} positions a row, "
          f"{args.passes} passes")
    print(f"whole     {whole * 1000:8.1f} ms  {[round(t * 1000, 1) for t in times['whole']]}")
    print(f"remember  {remember * 1000:8.1f} ms  {[round(t * 1000, 1) for t in times['remember']]}")
    print(f"whole / remember: {whole / remember:.1f}x")


if __name__ == "__main__":
    main()
