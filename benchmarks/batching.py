"""Continuous batching: 8 concurrent requests vs the same 8 one after another, same server, same run.

    python -m benchmarks.batching [--requests 8] [--tokens 128] [--against-mlx-lm]

Prints aggregate generated tokens/s both ways and the ratio concurrent / sequential.
With ``--against-mlx-lm``: the same 8 concurrent requests to ``mlx_lm.server`` on
the same model and BLAS (loaded first), rounds alternating between the two
servers, and the ratio mlxcel / mlx_lm.server of aggregate tokens/s (run it
before every performance commit).
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import httpx  # noqa: E402

from benchmarks._common import add_model_arguments, bench_model, median, mlx_lm_server, server  # noqa: E402

PROMPTS = ["def wrap(text, width=70):", "class Template:", "import os\nimport sys\n", "    return",
           "for line in lines:", "def dedent(text):", "if __name__ == '__main__':", "x = {}"]


def one(client: httpx.Client, url: str, prompt: str, tokens: int) -> int:
    body = client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": tokens,
                                                       "temperature": 0}).json()
    return int(body["usage"]["completion_tokens"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--against-mlx-lm", action="store_true")
    add_model_arguments(parser, rounds=3, tokens=128)
    args = parser.parse_args()
    model = bench_model("llama", args.hidden, args.layers)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
    if args.against_mlx_lm:
        against_mlx_lm(model, prompts, args.tokens, args.rounds)
        return
    print(f"model: {model.name}, {args.requests} requests x {args.tokens} tokens, {args.rounds} rounds")
    sequential, concurrent = [], []
    with server(model, "--parallel", str(args.requests)) as url, httpx.Client(timeout=600) as client, \
            ThreadPoolExecutor(args.requests) as pool:
        one(client, url, "warm up", 8)
        for _ in range(args.rounds):
            start = time.perf_counter()
            total = sum(one(client, url, p, args.tokens) for p in prompts)
            sequential.append(total / (time.perf_counter() - start))
            start = time.perf_counter()
            total = sum(pool.map(lambda p: one(client, url, p, args.tokens), prompts))
            concurrent.append(total / (time.perf_counter() - start))
    print(f"one after another: {median(sequential):8.1f} tok/s  {[round(x, 1) for x in sequential]}")
    print(f"concurrent:        {median(concurrent):8.1f} tok/s  {[round(x, 1) for x in concurrent]}")
    print(f"ratio concurrent / sequential: {median(concurrent) / median(sequential):.2f}")


def against_mlx_lm(model: Path, prompts: list[str], tokens: int, rounds: int) -> None:
    rates: dict[str, list[float]] = {"mlxcel": [], "mlx_lm.server": []}
    with server(model, "--parallel", str(len(prompts))) as ours, mlx_lm_server(model) as theirs, \
            httpx.Client(timeout=600) as client, ThreadPoolExecutor(len(prompts)) as pool:
        for url in (ours, theirs):
            one(client, url, "warm up", 8)
        for _ in range(rounds):
            for name, url in (("mlxcel", ours), ("mlx_lm.server", theirs)):
                start = time.perf_counter()
                total = sum(pool.map(lambda p: one(client, url, p, tokens), prompts))  # noqa: B023
                rates[name].append(total / (time.perf_counter() - start))
    for name, values in rates.items():
        print(f"{name:14s} {median(values):8.1f} tok/s  {[round(x, 1) for x in values]}")
    print(f"ratio mlxcel / mlx_lm.server, {len(prompts)} concurrent: "
          f"{median(rates['mlxcel']) / median(rates['mlx_lm.server']):.2f}")


if __name__ == "__main__":
    main()
