"""B=1 decode with the MTP burst pinned on vs off: same prompts, same run, two servers side by side.

    python -m benchmarks.mtp_speedup [--drafter aligned --context 0.05] [--k 2 3 4] [--schema | --zero-bias]
        [--depth TOKENS]

For each K: acceptance, mean accepted drafts per round, tokens per round, both
decode rates (the server's own timings, median over the prompts, requests
alternating between the two servers) and the ratio on / off. With
``--schema`` every request (both sides) is constrained by
the constrained-decoding benchmarks' JSON schema: the burst with the grammar
at every verified position against classic decode with the grammar. With
``--zero-bias`` every request carries ``logit_bias: {"0": 0}``: the logits
processors' path, position by position, with the tokens (and so the
acceptance) of a plain run, i.e. its overhead alone. With ``--depth N`` every
prompt starts with the same N tokens of words (the model's context window made
to fit): decode at depth. Each prompt is then prefilled once per server; the
servers share the cache directory, so the servers of later K read it from the
prefix cache's disk tier instead of prefilling it again.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import httpx

from benchmarks._common import NOTES_SCHEMA, complete, context_window, decode_rate, median, mtp_model, server, words

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
    parser.add_argument("--depth", type=int, default=0, help="tokens of context before every prompt")
    processors = parser.add_mutually_exclusive_group()
    processors.add_argument("--schema", action="store_true", help="every request under a JSON schema")
    processors.add_argument("--zero-bias", action="store_true", help="every request with a logit bias of 0")
    args = parser.parse_args()
    fields: dict[str, Any] = {}
    if args.schema:
        fields["response_format"] = {"type": "json_schema", "json_schema": {"name": "notes", "schema": NOTES_SCHEMA}}
    if args.zero_bias:
        fields["logit_bias"] = {"0": 0}
    positions = context_window(args.depth + args.tokens, 4096)
    model = args.model or mtp_model(args.drafter, args.context, args.layers, args.hidden, positions)
    prompts = args.prompts.read_text().split("\n\n") if args.prompts else PROMPTS
    if args.depth:
        import random

        from transformers import AutoTokenizer

        filler = words(AutoTokenizer.from_pretrained(model), args.depth, random.Random(0))
        prompts = [filler + "\n" + prompt for prompt in prompts]
    extra = dict(item.split("=", 1) for item in args.server_env)
    print(f"model: {model.name}, {args.tokens} tokens, {len(prompts)} prompts"
          f"{f' after {args.depth} tokens of context' if args.depth else ''}"
          f"{', under a JSON schema' if args.schema else ''}{', logit_bias 0' if args.zero_bias else ''}")
    print(f"{'K':>2} {'accept':>7} {'drafts/round':>12} {'tok/round':>9} {'off tok/s':>9} {'on tok/s':>9} {'ratio':>6}")
    for k in args.k:
        env = {**extra, "MLXCEL_DRAFT_BLOCK_SIZE": str(k)}
        with server(model, "--mtp", env={**env, "MLXCEL_ENABLE_MTP_B1": "0"}) as off, \
                server(model, "--mtp", env={**env, "MLXCEL_ENABLE_MTP_B1": "1"}) as on, \
                httpx.Client(timeout=7200) as client:  # an 8k prefill of the 0.87 GB pairing takes over 10 min
            complete(client, off, "warm up", 8, **fields)
            complete(client, on, "warm up", 8, **fields)
            off_rates, on_rates, proposed, accepted, rounds, emitted = [], [], 0, 0, 0, 0
            for prompt in prompts:
                off_rates.append(decode_rate(complete(client, off, prompt, args.tokens, **fields)))
                body = complete(client, on, prompt, args.tokens, **fields)
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
