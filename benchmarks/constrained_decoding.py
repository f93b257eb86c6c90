"""The cost of constrained decoding: decode tokens/s with and without a JSON schema, B=1 and batched.

    python -m benchmarks.constrained_decoding [--batch 4] [--tokens 64] [--rounds 3]

One server, one run: per round, one request alone and ``--batch`` at once,
each free and under ``response_format: json_schema`` (llguidance's mask at
every step, and a read-back of each sampled token the mask needs). The rate
is the server's own ``timings`` (generated tokens / decode time, pooled over
the requests). Prints the medians and the ratio schema / free for each.
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import httpx  # noqa: E402

from benchmarks._common import NOTES_SCHEMA as SCHEMA  # noqa: E402
from benchmarks._common import add_model_arguments, bench_model, decode_rate, median, server  # noqa: E402

PROMPTS = ["def wrap(text, width=70):", "class Template:", "import os\nimport sys\n", "for line in lines:"]


def one(client: httpx.Client, url: str, prompt: str, tokens: int, constrained: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": tokens, "temperature": 0}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "notes", "schema": SCHEMA}}
    response = client.post(f"{url}/v1/completions", json=body)
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    add_model_arguments(parser, rounds=3, tokens=64)
    args = parser.parse_args()
    model = bench_model("llama", args.hidden, args.layers)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]
    print(f"model: {model.name}, {args.tokens} tokens, batch {args.batch}, {args.rounds} rounds")
    rates: dict[tuple[int, bool], list[float]] = {(b, c): [] for b in (1, args.batch) for c in (False, True)}
    tokens: dict[tuple[int, bool], list[int]] = {key: [] for key in rates}
    with server(model, "--parallel", str(args.batch)) as url, httpx.Client(timeout=600) as client, \
            ThreadPoolExecutor(args.batch) as pool:
        for constrained in (False, True):  # warm up both paths (llguidance's tokenizer is built on first use)
            one(client, url, "warm up", 8, constrained)
        for _ in range(args.rounds):
            for constrained in (False, True):
                alone = one(client, url, prompts[0], args.tokens, constrained)
                bodies = list(pool.map(lambda p, c=constrained: one(client, url, p, args.tokens, c), prompts))
                for batch, measured in ((1, [alone]), (args.batch, bodies)):
                    rates[batch, constrained].append(decode_rate(measured))
                    tokens[batch, constrained] += [b["usage"]["completion_tokens"] for b in measured]
    for batch in (1, args.batch):
        free, schema = median(rates[batch, False]), median(rates[batch, True])
        print(f"B={batch}: free {free:8.1f} tok/s, json_schema {schema:8.1f} tok/s, ratio schema / free "
              f"{schema / free:.2f}  (free {[round(x, 1) for x in rates[batch, False]]}, "
              f"schema {[round(x, 1) for x in rates[batch, True]]}; tokens per request: free "
              f"{median([float(t) for t in tokens[batch, False]]):.0f}, schema "
              f"{median([float(t) for t in tokens[batch, True]]):.0f})")


if __name__ == "__main__":
    main()
