"""Does the verdict the policy settles on agree with a measured A/B of the same pairing?

    python -m benchmarks.verdict_accuracy [--k 4]

For pairings whose drafters differ in quality: a fresh server profiles four
single requests and settles (verdict, acceptance, estimated speedup); then the
burst pinned on vs off, side by side, on held-out prompts gives the measured
speedup. The verdict is right when it picks the faster side; regret is the
throughput the worse choice loses.
"""

from __future__ import annotations

import argparse
import tempfile

import httpx

from benchmarks._common import complete, decode_rate, median, mtp_model, server

PROFILE = ["def wrap(text, width=70):", "class Template:", "import os\nimport sys\n", "for line in lines:"]
HELD_OUT = ["def dedent(text):", "if __name__ == '__main__':", "while True:", "return self.value",
            "try:\n    import json", "x = {'a': 1}"]
PAIRINGS = [("aligned", 0.0), ("aligned", 0.003), ("aligned", 0.01), ("aligned", 0.05), ("random", 1.0)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    print(f"K={args.k}, {args.tokens} tokens; verdict from 4 profiled requests, "
          f"A/B on {len(HELD_OUT)} held-out prompts")
    print(f"{'pairing':<32} {'accept':>6} {'est.':>5} {'verdict':>8} {'A/B':>5} {'right':>5} {'regret':>6}")
    for drafter, context in PAIRINGS:
        model = mtp_model(drafter, context)
        env = {"MLXCEL_DRAFT_BLOCK_SIZE": str(args.k)}
        with tempfile.TemporaryDirectory() as cache, httpx.Client(timeout=600) as client:
            with server(model, "--mtp", env={**env, "MLXCEL_CACHE_DIR": cache}) as url:
                for prompt in PROFILE:
                    complete(client, url, prompt, args.tokens)
                policy = client.get(f"{url}/v1/internal/mtp-policy").json()
            with server(model, "--mtp", env={**env, "MLXCEL_ENABLE_MTP_B1": "0"}) as off, \
                    server(model, "--mtp", env={**env, "MLXCEL_ENABLE_MTP_B1": "1"}) as on:
                complete(client, off, "warm up", 8)
                complete(client, on, "warm up", 8)
                off_rates, on_rates = [], []
                for prompt in HELD_OUT:
                    off_rates.append(decode_rate(complete(client, off, prompt, args.tokens)))
                    on_rates.append(decode_rate(complete(client, on, prompt, args.tokens)))
        measured = median(on_rates) / median(off_rates)
        verdict = policy["verdict"]
        right = (verdict == "enable") == (measured > 1.0)
        regret = 0.0 if right else (1 - measured if verdict == "enable" else 1 - 1 / measured)
        print(f"{model.name:<32} {policy['acceptance_rate']:>6.2f} {policy['estimated_speedup'] or 0:>5.2f} "
              f"{verdict:>8} {measured:>5.2f} {'yes' if right else 'NO':>5} {regret:>6.1%}")


if __name__ == "__main__":
    main()
