"""``/health`` latency while eight 3.8 MB valid bodies are parsed, for the server of a given source tree.

Run it for two trees, one after the other, to compare a change (a ``git worktree`` of the commit before
it, and the working tree): ``python -m benchmarks.large_bodies --tree /tmp/before`` then ``--tree .``.
The body's unknown field holds 200,000 small arrays, which the depth and surrogate walk visits.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import httpx

from benchmarks._common import bench_model, health_during, server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tree", type=Path, default=Path("."), help="the source tree whose server is measured")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = bench_model(hidden=64, layers=2, name="large-bodies")
    tree = args.tree.resolve()
    with server(model, tree=tree) as url:
        body = json.dumps({"prompt": "x", "max_tokens": 1, "extra": [[i, str(i)] for i in range(200_000)]}).encode()
        latencies: list[float] = []
        for _ in range(args.rounds):
            latencies += _round(url, body)
        print(f"{tree}: {len(body)} B bodies; /health max {max(latencies):.3f} s, "
              f"median {statistics.median(latencies) * 1000:.1f} ms, {len(latencies)} polls answered")


def _round(url: str, body: bytes) -> list[float]:
    def post() -> None:
        with httpx.Client(timeout=300) as client:
            answer = client.post(f"{url}/v1/completions", content=body, headers={"Content-Type": "application/json"})
            assert answer.status_code == 200, answer.text[:200]

    return health_during(url, post, threads=8, interval=0.01)


if __name__ == "__main__":
    main()
