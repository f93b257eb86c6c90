"""What speculation in the batch costs a classic step: mlx-lm's step alone vs the same step with the
speculation attached and parked.

    python -m benchmarks.batch_overhead [--layers 24 --hidden 1024 | --layers 12 --released] [--width 8]
        [--steps 64] [--passes 4] [--depth TOKENS]

In process, on the MLX thread, one Qwen 3.5 pairing with its MTP head. ``plain``: a
``ContinuousBatch`` without speculation (the classic step, as a server without ``--mtp``
runs it). ``parked``: the same batch with speculation attached, its rule restored with
costs under which every K loses, so its steps are classic (its look at K = 1 after
each cooldown is left out of the timing) and pay what speculation adds to them: the
hidden-state tap (the target adapter's forward), pairing each row's hidden state with
its next token for the drafter (and reading them every 64 steps: *steps* of 64 or more hold one such
read a pass; fewer, none), the eligibility check and the rule's choice. Passes alternate; prints the median
milliseconds a step of each and the ratio.
``--depth N``: every row starts from the same N-token prompt, prefilled once and its cache copied into each
row (a resumed prompt's way in), its drafter's cache too (the head has read the whole prompt, as a row that ran
alone first has), so that the steps, and the drafters' reads every 64 of them, read N keys a row.
``--released``: the pairing's layers shaped as Qwen3.5-0.8B's (``benchmarks/batch_mtp.py``).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import mlx.core as mx  # noqa: E402

from benchmarks._common import context_window, mtp_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--k", type=int, default=4, help="verify width (drafts per row: K - 1)")
    parser.add_argument("--depth", type=int, default=0, help="tokens of context in every row")
    parser.add_argument("--released", action="store_true", help="layers shaped as Qwen3.5-0.8B's (hidden 1024)")
    args = parser.parse_args()

    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel.checkpoints import inspect_checkpoint, inspect_drafter, load_drafter, speculative_target
    from mlxcel.engine.batch import ContinuousBatch
    from mlxcel.engine.batch_speculation import BatchSpeculation
    from mlxcel.engine.requests import BurstStats
    from mlxcel.models.attention import mlx_thread
    from mlxcel.policy.draft_length import DraftLength

    positions = context_window(args.depth, 4096)
    path = mtp_model("aligned", 0.0, args.layers, args.hidden, positions, args.released)
    with mlx_thread():
        info = inspect_checkpoint(path)
        model, _ = load(str(path))
        target = speculative_target(info.model_type, model)
        head = load_drafter(inspect_drafter(info, mtp=True, draft_model=None), info, model)
        stream = mx.default_stream(mx.default_device())
        drafts = args.k - 1
        context = [5 + i % 400 for i in range(args.depth)]
        prefilled = read = None
        if context:  # once: each row starts from a copy of its cache, its drafter from a copy of what it read
            prefilled = make_prompt_cache(model)
            hiddens = []
            for start in range(0, len(context), 512):
                _, hidden = target.forward(mx.array([context[start:start + 512]]), prefilled)
                mx.eval(hidden, [c.state for c in prefilled])
                hiddens.append(hidden)
            alone = head.new_sequence(prefilled)
            alone.catch_up(mx.concatenate(hiddens, axis=1)[:, :-1], mx.array([context[1:]]))
            read = alone.snapshot()

        def batch(speculating: bool) -> ContinuousBatch[object]:
            speculation = rule = None
            if speculating:
                speculation = BatchSpeculation(model, target, head, "wide")  # type: ignore[arg-type]
                rule = DraftLength(drafts)
                losing = {"0": 0.001, **{str(k): 1.0 for k in range(1, drafts + 1)}}
                assert rule.restore({"max_drafts": drafts, "cells": [
                    {"width": args.width, "band": band, "seconds": losing} for band in range(4)]}) is None
            made: ContinuousBatch[object] = ContinuousBatch(model, frozenset(), args.width, 512, stream,
                                                            speculation, rule)
            for i in range(args.width):
                cache = copy.deepcopy(prefilled) if prefilled is not None else None
                uid = made.insert(object(), [5 + i, 7, 9, 11 + i], cache, list(context), 100_000, None, [], ())
                if speculation is not None:
                    drafter = None
                    if read is not None:
                        drafter = head.new_sequence(cache)
                        drafter.restore(read)
                    speculation.join(uid, drafter, None, BurstStats(), True)
            for _ in range(8):  # prefill, and the first steps' one-off work
                made.step()
            return made

        # A batch per pass and side, made when its pass starts: both sides' passes start from the same
        # short context, and no batch holds memory while the other is timed.
        times: dict[str, list[float]] = {"plain": [], "parked": []}
        print(f"model: {path.name}, {args.width} rows at {args.depth} tokens, {args.steps} steps x {args.passes} "
              "passes", flush=True)
        for number in range(1, args.passes + 1):
            for side in times:
                made = batch(side == "parked")
                spent, steps = 0.0, 0
                while steps < args.steps:
                    start = time.perf_counter()
                    stepped = made.step()
                    # Counted: classic steps of every row (not the parked rule's look at K = 1 after a cooldown).
                    if stepped.drafts == 0 and len(stepped.tokens) == args.width:
                        spent, steps = spent + time.perf_counter() - start, steps + 1
                times[side].append(spent / steps * 1000)
                made.close()
                # A pass of the released shapes at 8 rows takes minutes: say where the run is.
                print(f"pass {number} of {args.passes}: {side} {times[side][-1]:.2f} ms a step", flush=True)
    plain, parked = (statistics.median(times[side]) for side in ("plain", "parked"))
    print(f"plain  {plain:7.2f} ms a step  {[round(t, 2) for t in times['plain']]}")
    print(f"parked {parked:7.2f} ms a step  {[round(t, 2) for t in times['parked']]}")
    print(f"parked / plain: {parked / plain:.3f}")


if __name__ == "__main__":
    main()
