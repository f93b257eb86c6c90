"""Rollback cost per round for the hybrid Qwen 3.5 target, as a share of the round.

    python -m benchmarks.rollback [--k 4]

Gated-delta layers keep recurrent state that cannot be trimmed. mlxcel's
verify keeps each mixer's state after every token, and a rollback selects the
state after the last accepted one. The first version ran a plain verify and,
when drafts were rejected, restored the state from before it and recomputed
the accepted tokens (one extra forward of a+1 tokens). Verifying token by token
needs no rollback but costs K single-token forwards every round. This prints,
for each number of accepted drafts a: mlxcel's verify and rollback, the plain
verify and the recompute with its share of a round, and token by token.
"""

from __future__ import annotations

import argparse
import time

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from benchmarks._common import median, mtp_model  # noqa: E402
from mlxcel.families.qwen3_5.target import Qwen35Target  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    path = mtp_model("aligned", 0.01)
    model, tokenizer = load(str(path))
    target = Qwen35Target(model)
    k = args.k
    cache = make_prompt_cache(model)
    target.forward(mx.array([tokenizer.encode("def wrap(text, width=70):" * 4)]), cache)
    mx.eval([c.state for c in cache])
    block = mx.array([[5, 17, 99, 123, 7, 8, 9, 10][:k]])

    def save() -> list[object]:
        return [None if c.is_trimmable() else list(c.cache) for c in cache]

    def restore(saved: list[object], fed: int) -> None:
        """Back to the state *saved* before *fed* tokens were fed."""
        for c, state in zip(cache, saved, strict=True):
            if state is None:
                c.trim(fed)
            else:
                c.cache = state

    def seconds(tokens: mx.array) -> float:
        start = time.perf_counter()
        mx.eval(target.forward(tokens, cache)[1])
        return time.perf_counter() - start

    print(f"model: {path.name}, K={k}, median of {args.repeats}; a round with a rejection:")
    print(f"{'a':>2} {'verify ms':>9} {'rollback ms':>11} {'share':>6} {'plain verify ms':>15} "
          f"{'recompute ms':>12} {'share':>6} {'token by token ms':>17}")
    for accepted in range(k - 1):
        verify, rollback, plain, recompute, chain = [], [], [], [], []
        for _ in range(args.repeats):
            saved = save()
            start = time.perf_counter()  # mlxcel: the verify keeps the states, the rollback selects
            verified = target.verify(block, cache, "wide")
            mx.eval(verified.logits, verified.hidden, [c.state for c in cache])
            verify.append(time.perf_counter() - start)
            start = time.perf_counter()
            target.rollback(cache, verified, kept=accepted + 1)
            mx.eval([c.state for c in cache])
            rollback.append(time.perf_counter() - start)
            restore(saved, accepted + 1)
            plain.append(seconds(block))  # the first version: a plain verify, then restore and recompute
            restore(saved, k)
            recompute.append(seconds(block[:, :accepted + 1]))
            restore(saved, accepted + 1)
            chain.append(sum(seconds(block[:, i:i + 1]) for i in range(k)))
            restore(saved, k)
        v, r, p, w, t = (median(x) * 1000 for x in (verify, rollback, plain, recompute, chain))
        print(f"{accepted:>2} {v:>9.2f} {r:>11.2f} {r / (v + r):>6.0%} {p:>15.2f} {w:>12.2f} {w / (p + w):>6.0%} "
              f"{t:>17.2f}")


if __name__ == "__main__":
    main()
