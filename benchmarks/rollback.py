"""Rollback cost per round for the hybrid Qwen 3.5 target, as a share of the round.

    python -m benchmarks.rollback [--k 4]

Gated-delta layers keep recurrent state that cannot be trimmed. mlxcel keeps
the state arrays before the verify and, when drafts are rejected, restores
them and recomputes the accepted tokens (one extra forward of a+1 tokens).
The alternative that needs no rollback, verifying token by token and keeping
the state after each, costs K single-token forwards every round. This prints,
for each number of accepted drafts a, the time of the verify, of the restore
+ recompute, its share of a round, and the token-by-token alternative.
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
from mlxcel.engine.mtp import TargetModel  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    path = mtp_model("aligned", 0.01)
    model, tokenizer = load(str(path))
    target = TargetModel(model)
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

    def recorded_verify() -> list[mx.array]:
        """A verify that records the gated-delta mixers' inputs, as the burst's does."""
        for _, mixer in target.mixers:
            mixer.recorded = []
        mx.eval(target.forward(block, cache)[1])
        inputs = [mx.concatenate(mixer.recorded or [], axis=1) for _, mixer in target.mixers]
        for _, mixer in target.mixers:
            mixer.recorded = None
        return inputs

    print(f"model: {path.name}, K={k}, median of {args.repeats}; rollback of a round with a rejection:")
    print(f"{'a':>2} {'verify ms':>9} {'mixers only ms':>14} {'share':>6} {'whole model ms':>14} {'share':>6} "
          f"{'token-by-token verify ms':>24}")
    for accepted in range(k - 1):
        verify, mixers, whole, chain = [], [], [], []
        for _ in range(args.repeats):
            saved = save()
            start = time.perf_counter()
            inputs = recorded_verify()
            verify.append(time.perf_counter() - start)
            start = time.perf_counter()  # mlxcel's rollback: trim attention, re-run the mixers
            for c in cache:
                if c.is_trimmable():
                    c.trim(k - 1 - accepted)
            states = []
            for (index, mixer), recorded in zip(target.mixers, inputs, strict=True):
                cache[index].cache = saved[index]
                mixer.inner(recorded[:, :accepted + 1], None, cache[index])
                states.extend(cache[index].cache)
            mx.eval(states)
            mixers.append(time.perf_counter() - start)
            restore(saved, accepted + 1)
            start = time.perf_counter()  # the first version: restore, recompute the whole model
            mx.eval(target.forward(block[:, :accepted + 1], cache)[1])
            whole.append(time.perf_counter() - start)
            restore(saved, accepted + 1)
            chain.append(sum(seconds(block[:, i:i + 1]) for i in range(k)))
            restore(saved, k)
        v, m, w, t = (median(x) * 1000 for x in (verify, mixers, whole, chain))
        print(f"{accepted:>2} {v:>9.2f} {m:>14.2f} {m / (v + m):>6.0%} {w:>14.2f} {w / (v + w):>6.0%} {t:>24.2f}")


if __name__ == "__main__":
    main()
