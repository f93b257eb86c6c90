"""Does the verdict the policy settles on agree with a measured A/B of the same pairing?

    python -m benchmarks.verdict_accuracy [--k 4] [--depth TOKENS] [--contexts 0.0 0.003 ...]

For pairings whose drafters differ in quality: a fresh server profiles four
single requests and settles (verdict, acceptance, estimated speedup); then the
burst pinned on vs off, side by side, on held-out prompts gives the measured
speedup. The verdict is right when it picks the faster side; regret is the
throughput the worse choice loses.

With ``--depth N`` there are two classes of request: short prompts, and long
ones that start with the same N tokens of words (an agent's system prompt; the
prefix cache holds it after the first). The profiling window alternates them,
the settled server then shows which side it picks for each class (a depth
limit can skip the burst for the long ones), and the A/B and the regret are
measured per class.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from typing import Any

import httpx

from benchmarks._common import complete, context_window, decode_rate, median, mtp_model, server, words

PROFILE = ["def wrap(text, width=70):", "class Template:", "import os\nimport sys\n", "for line in lines:"]
HELD_OUT = ["def dedent(text):", "if __name__ == '__main__':", "while True:", "return self.value",
            "try:\n    import json", "x = {'a': 1}"]
PAIRINGS = [("aligned", 0.0), ("aligned", 0.003), ("aligned", 0.01), ("aligned", 0.05), ("random", 1.0)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--depth", type=int, default=0, help="also a class of prompts this many tokens deep")
    parser.add_argument("--contexts", type=float, nargs="+", help="only the pairings of these context scales")
    args = parser.parse_args()
    pairings = [p for p in PAIRINGS if args.contexts is None or p[1] in args.contexts]
    print(f"K={args.k}, {args.tokens} tokens; verdict from 4 profiled requests, "
          f"A/B on {len(HELD_OUT)} held-out prompts{f' per class (short, {args.depth} deep)' if args.depth else ''}")
    print(f"{'pairing':<32} {'class':>6} {'accept':>6} {'est.':>5} {'verdict':>8} {'limit':>6} {'picks':>7} "
          f"{'A/B':>5} {'right':>5} {'regret':>6}")
    for drafter, context in pairings:
        positions = context_window(args.depth + args.tokens, 4096)
        model = mtp_model(drafter, context, positions=positions)
        classes = {"short": ""}
        if args.depth:
            from transformers import AutoTokenizer

            classes["long"] = words(AutoTokenizer.from_pretrained(model), args.depth, random.Random(0)) + "\n"
        for row in _pairing(model, classes, args.k, args.tokens):
            print(row)


def _pairing(model: Any, classes: dict[str, str], k: int, tokens: int) -> list[str]:
    """One pairing's rows: profile it, see what it picks per class, then measure each class on and off."""
    env = {"MLXCEL_DRAFT_BLOCK_SIZE": str(k)}
    heads = list(classes.values())
    with tempfile.TemporaryDirectory() as cache, httpx.Client(timeout=1800) as client:
        with server(model, "--mtp", env={**env, "MLXCEL_CACHE_DIR": cache}) as url:
            for i, prompt in enumerate(PROFILE):
                complete(client, url, heads[i % len(heads)] + prompt, tokens)
            policy = client.get(f"{url}/v1/internal/mtp-policy").json()
            picks = {name: complete(client, url, head + HELD_OUT[0], tokens)["timings"]["draft_rounds"] > 0
                     for name, head in classes.items()}
        with server(model, "--mtp", env={**env, "MLXCEL_ENABLE_MTP_B1": "0"}) as off, \
                server(model, "--mtp", env={**env, "MLXCEL_ENABLE_MTP_B1": "1"}) as on:
            rates: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in classes}
            for name, head in classes.items():
                complete(client, off, head + "warm up", 8)
                complete(client, on, head + "warm up", 8)
                for prompt in HELD_OUT:
                    rates[name][0].append(decode_rate(complete(client, off, head + prompt, tokens)))
                    rates[name][1].append(decode_rate(complete(client, on, head + prompt, tokens)))
    rows = []
    for name in classes:
        measured = median(rates[name][1]) / median(rates[name][0])
        burst = picks[name]
        right = burst == (measured > 1.0)
        regret = 0.0 if right else (1 - measured if burst else 1 - 1 / measured)
        rows.append(f"{model.name:<32} {name:>6} {policy['acceptance_rate']:>6.2f} "
                    f"{policy['estimated_speedup'] or 0:>5.2f} {policy['verdict']:>8} "
                    f"{policy.get('depth_limit') or '-':>6} {'burst' if burst else 'classic':>7} {measured:>5.2f} "
                    f"{'yes' if right else 'NO':>5} {regret:>6.1%}")
    return rows


if __name__ == "__main__":
    main()
