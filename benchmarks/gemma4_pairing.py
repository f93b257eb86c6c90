"""Gemma 4 with its assistant: what one draft step costs, and the burst's acceptance and speedup.

    python -m benchmarks.gemma4_pairing [--hidden 768 --layers 12 --window 512] [--k 2 3 4]
                                        [--blas off auto] [--tokens 96]

The pairing is mlxcel/families/gemma4/tiny.py's at a realistic width: the permutation target (its next
token a fixed permutation of the current one, every layer still computed) and an assistant built to
agree with it on all tokens, or on 60% of them (each 2 layers at the target's width). For each BLAS
(``off``: mlx's reference BLAS; ``auto``: the system OpenBLAS when there is one):

- the cost of one assistant draft step as a share of one target decode step (in-process, median of
  many, evaluated one at a time), and
- for each assistant and K: acceptance, tokens per round, and B=1 decode tokens/s with the burst
  pinned off vs on, two servers side by side, requests alternating (the server's own timings). Under
  OpenBLAS the probe may veto these pairings (it multiplies 2+ rows with other kernels): the burst is
  then run anyway (``MLXCEL_MTP_ALLOW_INEXACT=1``) to measure its speed, and the line says so.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks._common import BENCH_DIR, complete, decode_rate, median, server

PROMPTS = ["def wrap(text, width=70):", "class Template:", "import os\nimport sys\n", "for line in lines:"]
ASSISTANTS = {"agreeing": 1.0, "partly": 0.6}


def pairing(hidden: int, layers: int, window: int) -> dict[str, Path]:
    from mlxcel.families.gemma4.tiny import build_assistant, build_target

    root = BENCH_DIR / f"gemma4-h{hidden}-l{layers}-w{window}"
    target = root / "target"
    if not (target / "model.safetensors").exists():
        build_target(target, kind="permutation", hidden=hidden, layers=layers, window=window)
    paths = {"target": target}
    for name, agreement in ASSISTANTS.items():
        paths[name] = root / name
        if not (paths[name] / "model.safetensors").exists():
            build_assistant(paths[name], target, kind="agreeing", agreement=agreement)
    return paths


def step_costs(paths: dict[str, Path], blocks: list[int], repeats: int = 60) -> dict[str, object]:
    """Seconds of one target decode step and one assistant draft step, and the exactness probe's split
    at each K (None: vetoed), under this process's BLAS."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel.blas import blas_kind, load_fast_blas
    from mlxcel.checkpoints import (
        inspect_checkpoint,
        inspect_drafter,
        load_checkpoint,
        load_drafter,
        speculative_target,
    )
    from mlxcel.engine.exactness import probe_exactness

    load_fast_blas()
    info = inspect_checkpoint(paths["target"])
    model, _ = load_checkpoint(info)
    drafter = load_drafter(inspect_drafter(info, mtp=False, draft_model=paths["agreeing"]), info, model)
    target = speculative_target(info.model_type, model)
    cache = make_prompt_cache(model)
    prompt = list(range(3, 67))
    _, hidden = target.forward(mx.array([prompt]), cache)
    sequence = drafter.new_sequence(cache)
    sequence.catch_up(hidden, mx.array([[*prompt[1:], 70]]))
    mx.eval([c.state for c in cache])

    def timed(run: object) -> float:
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            mx.eval(run())  # type: ignore[operator]
            samples.append(time.perf_counter() - started)
        return statistics.median(samples[repeats // 4:])

    token = mx.array([[70]])

    def target_step() -> mx.array:
        logits = model(token, cache=cache)
        for c in cache:
            c.trim(1) if not hasattr(c, "rewind") else c.rewind(1)
        return logits

    splits = {k: probe_exactness(target, model, lambda: make_prompt_cache(model), k, 512,
                                 info.context_length).split for k in blocks}
    return {"blas": blas_kind(), "target": timed(target_step), "draft": timed(lambda: sequence.draft(1)),
            "splits": splits}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--k", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--blas", nargs="+", default=["off", "auto"])
    parser.add_argument("--step-costs", action="store_true", help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.step_costs:  # the child's BLAS, before the checkpoint builders import mlx
        from mlxcel.blas import load_fast_blas

        load_fast_blas()
    paths = pairing(args.hidden, args.layers, args.window)
    if args.step_costs:
        from mlxcel.models.attention import mlx_thread

        with mlx_thread():  # the engine's attention rules (a `rows` verify's among them), as the worker has them
            print(json.dumps(step_costs(paths, args.k)))
        return
    size = sum(f.stat().st_size for f in paths["target"].glob("*.safetensors")) / 1e6
    print(f"target: permutation, hidden {args.hidden}, {args.layers} layers, window {args.window}, {size:.0f} MB; "
          f"assistants: 2 layers; {args.tokens} tokens, {len(PROMPTS)} prompts")
    for blas in args.blas:
        env = {**os.environ, "MLXCEL_BLAS": blas}
        child = subprocess.run([sys.executable, "-m", "benchmarks.gemma4_pairing", "--hidden", str(args.hidden),
                                "--layers", str(args.layers), "--window", str(args.window), "--step-costs",
                                "--k", *map(str, args.k)],
                               env=env, capture_output=True, text=True, check=True)
        costs: dict[str, Any] = json.loads(child.stdout.strip().splitlines()[-1])
        print(f"\nBLAS {costs['blas']}: target step {1000 * costs['target']:.2f} ms, assistant draft step "
              f"{1000 * costs['draft']:.2f} ms ({costs['draft'] / costs['target']:.2f} of a target step)")
        print(f"{'assistant':>9} {'K':>2} {'accept':>7} {'tok/round':>9} {'off tok/s':>9} {'on tok/s':>9} "
              f"{'ratio':>6}  probe")
        for name in ASSISTANTS:
            for k in args.k:
                settings = {"MLXCEL_BLAS": blas, "MLXCEL_DRAFT_BLOCK_SIZE": str(k), "MLXCEL_MTP_ALLOW_INEXACT": "1"}
                argv = ["--draft-model", str(paths[name])]
                with server(paths["target"], *argv, env={**settings, "MLXCEL_ENABLE_MTP_B1": "0"}) as off, \
                        server(paths["target"], *argv, env={**settings, "MLXCEL_ENABLE_MTP_B1": "1"}) as on, \
                        httpx.Client(timeout=600) as client:
                    complete(client, off, "warm up", 8)
                    complete(client, on, "warm up", 8)
                    off_rates, on_rates, proposed, accepted, rounds = [], [], 0, 0, 0
                    for prompt in PROMPTS:
                        off_rates.append(decode_rate(complete(client, off, prompt, args.tokens)))
                        body = complete(client, on, prompt, args.tokens)
                        on_rates.append(decode_rate(body))
                        t = body["timings"]
                        proposed, accepted, rounds = (proposed + t["draft_n"], accepted + t["draft_n_accepted"],
                                                      rounds + t["draft_rounds"])
                split = costs["splits"][str(k)]
                verdict = f"exact, {split}" if split else "vetoed: inexact here (run anyway)"
                print(f"{name:>9} {k:>2} {accepted / max(1, proposed):>7.2f} {1 + accepted / max(1, rounds):>9.2f} "
                      f"{median(off_rates):>9.1f} {median(on_rates):>9.1f} "
                      f"{median(on_rates) / median(off_rates):>6.2f}  {verdict}")


if __name__ == "__main__":
    main()
