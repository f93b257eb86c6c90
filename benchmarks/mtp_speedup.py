"""B=1 decode with the MTP burst pinned on vs off: same prompts, same run, two servers side by side.

    python -m benchmarks.mtp_speedup [--drafter aligned --context 0.05] [--k 2 3 4]

For each K: acceptance, mean accepted drafts per round, tokens per round, both
decode rates (the server's own timings, median over the prompts, requests
alternating between the two servers) and the ratio on / off.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx

from benchmarks._common import complete, decode_rate, median, mtp_model, server

PROMPTS = ["def wrap(text, width=70):", "class Template:", "import os\nimport sys\n", "for line in lines:",
           "def dedent(text):", "if __name__ == '__main__':"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, help="a checkpoint with an in-checkpoint MTP head "
                        "(default: a synthetic pairing built from --drafter and --context)")
    parser.add_argument("--prompts", type=Path, help="a file of prompts separated by blank lines")
    parser.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE")
    parser.add_argument("--drafter", default="aligned", choices=["aligned", "random"])
    parser.add_argument("--context", type=float, default=0.05,
                        help="target's context dependence (0: the head always agrees)")
    parser.add_argument("--k", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    args = parser.parse_args()
    model = args.model or mtp_model(args.drafter, args.context, args.layers, args.hidden)
    prompts = args.prompts.read_text().split("\n\n") if args.prompts else PROMPTS
    extra = dict(item.split("=", 1) for item in args.server_env)
    print(f"model: {model.name}, {args.tokens} tokens, {len(prompts)} prompts")
    print(f"{'K':>2} {'accept':>7} {'drafts/round':>12} {'tok/round':>9} {'off tok/s':>9} {'on tok/s':>9} {'ratio':>6}")
    for k in args.k:
        env = {**extra, "MLXCEL_DRAFT_BLOCK_SIZE": str(k)}
        with server(model, "--mtp", env={**env, "MLXCEL_ENABLE_MTP_B1": "0"}) as off, \
                server(model, "--mtp", env={**env, "MLXCEL_ENABLE_MTP_B1": "1"}) as on, \
                httpx.Client(timeout=600) as client:
            complete(client, off, "warm up", 8)
            complete(client, on, "warm up", 8)
            off_rates, on_rates, proposed, accepted, rounds, emitted = [], [], 0, 0, 0, 0
            for prompt in prompts:
                off_rates.append(decode_rate(complete(client, off, prompt, args.tokens)))
                body = complete(client, on, prompt, args.tokens)
                on_rates.append(decode_rate(body))
                t = body["timings"]
                proposed, accepted, rounds = proposed + t["draft_n"], accepted + t["draft_n_accepted"], \
                    rounds + t["draft_rounds"]
                emitted += t["predicted_n"]
        rate = accepted / proposed if proposed else 0.0
        per_round = accepted / rounds if rounds else 0.0
        print(f"{k:>2} {rate:>7.2f} {per_round:>12.2f} {per_round + 1:>9.2f} {median(off_rates):>9.1f} "
              f"{median(on_rates):>9.1f} {median(on_rates) / median(off_rates):>6.2f}")


if __name__ == "__main__":
    main()
