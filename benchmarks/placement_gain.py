"""Lone requests through an MTP-aware router vs a round-robin one, 3 nodes of which one runs the burst.

    python -m benchmarks.placement_gain [--requests 12] [--tokens 96] [--k 3]

Three `mlxcel serve` nodes on the synthetic Qwen 3.5 pairing whose head always
agrees (the pairing of benchmarks/mtp_speedup.py, context 0): one with its MTP
head (``--mtp``, the adaptive policy, profiled until it settles), two without.
Two routers front the same three nodes: ``--placement mtp-aware`` and
``--placement round-robin``. Lone greedy requests (one at a time, ``--gap``
seconds apart, so that the probes one router takes never see the other's
request still running) alternate between the routers; prints the median time to the last token of each, where
the requests went, and the ratio round-robin / MTP-aware (above 1: the
MTP-aware router is faster).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from contextlib import ExitStack

import httpx

from benchmarks._common import BENCH_DIR, median, mtp_model, server

PROMPTS = ["def wrap(text, width=70):", "class Template:", "import os\nimport sys\n", "for line in lines:"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=12, help="lone requests per router")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--gap", type=float, default=0.6,
                        help="seconds between requests: over two probe intervals, so that neither router "
                             "acts on a probe taken during the other's request")
    args = parser.parse_args()
    from mlxcel.testing.serving import serve_subprocess

    model = mtp_model("aligned", 0.0)
    env = {"MLXCEL_DRAFT_BLOCK_SIZE": str(args.k)}
    with ExitStack() as stack, httpx.Client(timeout=600) as client:
        nodes = [stack.enter_context(server(model, *extra, "--slots", env=env))
                 for extra in ((), ("--mtp",), ())]
        # Profile the MTP node with lone requests of its own until its verdict is in.
        for i in range(20):
            policy = client.get(f"{nodes[1]}/v1/internal/mtp-policy").json()
            if policy["state"] != "profiling":
                break
            client.post(f"{nodes[1]}/v1/completions", json={"prompt": PROMPTS[i % 4], "max_tokens": args.tokens,
                                                             "temperature": 0}).raise_for_status()
        print(f"MTP node: state {policy['state']}, verdict {policy['verdict']}, "
              f"acceptance {policy['acceptance_rate']}, K={policy['block_size']}")
        routers = {}
        for mode in ("mtp-aware", "round-robin"):
            backends = [a for url in nodes for a in ("--backend", url)]
            routers[mode] = stack.enter_context(serve_subprocess(
                ["--node-role", "router", *backends, "--placement", mode, "--health-interval", "0.25"], {},
                BENCH_DIR / f"router-{mode}-{time.time_ns()}.log"))
        time.sleep(1.5)  # every router has probed the nodes' policies
        for url in (*nodes, *routers.values()):
            client.post(f"{url}/v1/completions", json={"prompt": "warm up", "max_tokens": 8}).raise_for_status()
        seconds: dict[str, list[float]] = {mode: [] for mode in routers}
        placed: dict[str, Counter[str]] = {mode: Counter() for mode in routers}
        for i in range(args.requests):
            for mode, url in routers.items():
                started = time.perf_counter()
                response = client.post(f"{url}/v1/completions", json={
                    "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": args.tokens, "temperature": 0})
                response.raise_for_status()
                seconds[mode].append(time.perf_counter() - started)
                placed[mode][response.headers["x-mlxcel-node"]] += 1
                time.sleep(args.gap)
    print(f"pairing {model.name}, K={args.k}, {args.tokens} tokens, {args.requests} lone requests per router")
    for mode in routers:
        average = sum(seconds[mode]) / len(seconds[mode])
        print(f"{mode:<12} time to last token: median {median(seconds[mode]) * 1000:7.1f} ms, "
              f"mean {average * 1000:7.1f} ms; nodes {dict(sorted(placed[mode].items()))}")
    mean = {mode: sum(v) / len(v) for mode, v in seconds.items()}
    print(f"ratio round-robin / mtp-aware (mean time to last token): {mean['round-robin'] / mean['mtp-aware']:.3f}")


if __name__ == "__main__":
    main()
