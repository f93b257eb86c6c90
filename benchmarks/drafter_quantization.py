"""The drafter as stored vs quantized at load (``--draft-quantize``): acceptance and draft cost, side by side.

    python -m benchmarks.drafter_quantization [--context 0.01] [--k 3] [--tokens 96]

Runs the same greedy bursts (same prompts, same target) with each drafter in
turn, in one process, and prints per drafter: acceptance (accepted over
proposed drafts), the median time to draft K-1 tokens alone (evaluated, no
verify), and the decode rate of the whole burst.
"""

from __future__ import annotations

import argparse
import statistics
import time

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from benchmarks._common import mtp_model  # noqa: E402
from mlxcel.checkpoints import (  # noqa: E402
    inspect_checkpoint,
    inspect_drafter,
    load_drafter,
    speculative_target,
)
from mlxcel.engine.burst import Burst  # noqa: E402
from mlxcel.engine.solo import SoloDecoder  # noqa: E402
from mlxcel.models.attention import mlx_thread  # noqa: E402

PROMPTS = ["def wrap(text, width=70):", "class Template:", "import os\nimport sys\n", "for line in lines:"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=float, default=0.01, help="the synthetic pairing's context dependence")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args()
    path = mtp_model("aligned", args.context)
    model, tokenizer = load(str(path))
    target = speculative_target("qwen3_5", model)
    spec = inspect_drafter(inspect_checkpoint(path), mtp=True, draft_model=None)
    drafters = {label: load_drafter(spec, inspect_checkpoint(path), model, quantize=bits) for label, bits in
                (("as stored (fp32)", None), ("8-bit", 8), ("4-bit", 4))}
    stream = mx.default_stream(mx.default_device())
    results: dict[str, dict[str, list[float]]] = {label: {"accepted": [], "proposed": [], "draft": [], "rate": []}
                                                  for label in drafters}
    for _ in range(args.passes):
        for prompt in PROMPTS:
            for label, head in drafters.items():  # interleaved: every drafter sees the same machine state
                cache = make_prompt_cache(model)
                burst = Burst(target, head.new_sequence(cache), "half", None)
                solo = SoloDecoder(model, stream, None, cache, [], tokenizer.encode(prompt), burst)
                while not solo.prefilled:
                    solo.prefill_chunk(512)
                emitted: list[int] = []
                solo.classic_steps(1, False, lambda t, out=emitted: out.append(t) is not None)
                started = time.perf_counter()
                while len(emitted) < args.tokens:
                    solo.start_round(args.k)
                    emitted += solo.finish_round()
                results[label]["rate"].append(len(emitted) / (time.perf_counter() - started))
                results[label]["accepted"].append(burst.stats.accepted)
                results[label]["proposed"].append(burst.stats.proposed)
                draft_cache = make_prompt_cache(model)  # the draft alone: the same chain, evaluated, nothing else
                sequence = head.new_sequence(draft_cache)
                _, hidden = target.forward(mx.array([[emitted[-2]]]), draft_cache)
                sequence.catch_up(hidden, mx.array([[emitted[-1]]]))
                mx.eval(sequence.settle())
                started = time.perf_counter()
                mx.eval(sequence.draft(args.k - 1))
                results[label]["draft"].append(time.perf_counter() - started)
    print(f"model: {path.name}, K={args.k}, {args.tokens} tokens x {len(PROMPTS)} prompts x {args.passes} passes")
    print(f"{'drafter':<18} {'acceptance':>10} {'draft ms':>9} {'burst tok/s':>11}")
    for label, r in results.items():
        print(f"{label:<18} {sum(r['accepted']) / sum(r['proposed']):>10.3f} "
              f"{statistics.median(r['draft']) * 1000:>9.2f} {statistics.median(r['rate']):>11.1f}")


if __name__ == "__main__":
    with mlx_thread():  # the engine's attention rules, as the worker's thread has them
        main()
