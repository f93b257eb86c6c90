"""Decode through the router vs straight to the serving node, B=1 and 8 concurrent, same run.

    python -m benchmarks.router_overhead [--rounds 5] [--tokens 128] [--concurrent 8]

One `mlxcel serve` node (``--parallel`` = the concurrency) and one
`mlxcel serve --node-role router` in front of it, as separate processes on
loopback. B=1: the client-observed decode rate of a streamed greedy completion
(tokens after the first over the time between the first and last chunk).
Concurrent: N streamed completions at once, their generated tokens over the
wall time of the whole group. The two paths alternate round by round; prints
medians and the ratios router / direct.
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from benchmarks._common import BENCH_DIR, add_model_arguments, bench_model, median, server, stream_decode_rate

PROMPT = "def wrap(text, width=70, **kwargs):"


def group_rate(url: str, concurrent: int, tokens: int) -> float:
    """Aggregate tokens/s of *concurrent* streamed completions started together."""

    def one(_: int) -> int:
        with httpx.Client(timeout=600) as client, client.stream("POST", f"{url}/v1/completions", json={
                "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True}) as response:
            return sum(1 for line in response.iter_lines() if line.startswith("data: {")) - 1  # the final chunk

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrent) as pool:
        generated = sum(pool.map(one, range(concurrent)))
    return generated / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser, rounds=5, tokens=128)
    parser.add_argument("--concurrent", type=int, default=8)
    args = parser.parse_args()
    model = bench_model("llama", args.hidden, args.layers)
    print(f"model: {model.name} (fp32 random weights), {args.tokens} tokens, {args.rounds} rounds")

    from mlxcel.testing.serving import serve_subprocess

    rates: dict[str, list[float]] = {"direct B=1": [], "router B=1": [], "direct B=N": [], "router B=N": []}
    with server(model, "--parallel", str(args.concurrent)) as node, \
            serve_subprocess(["--node-role", "router", "--backend", node], {},
                             BENCH_DIR / f"router-{time.time_ns()}.log") as router, \
            httpx.Client(timeout=600) as client:
        for url in (node, router):
            stream_decode_rate(client, url, PROMPT, 16)  # warm up
            group_rate(url, args.concurrent, 8)
        for _ in range(args.rounds):
            for name, url in (("direct", node), ("router", router)):
                rates[f"{name} B=1"].append(stream_decode_rate(client, url, PROMPT, args.tokens))
            for name, url in (("router", router), ("direct", node)):
                rates[f"{name} B=N"].append(group_rate(url, args.concurrent, args.tokens))
    for name, values in rates.items():
        label = name.replace("N", str(args.concurrent))
        print(f"{label:<12} {median(values):8.1f} tok/s  {[round(v, 1) for v in values]}")
    for batch in ("B=1", "B=N"):
        ratio = median(rates[f"router {batch}"]) / median(rates[f"direct {batch}"])
        print(f"ratio router / direct, {batch.replace('N', str(args.concurrent))}: {ratio:.3f}")


if __name__ == "__main__":
    main()
