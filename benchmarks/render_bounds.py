"""What the chat routes' render bounds cost and save: each route's time for the report's bodies and for the
largest the bounds accept, and ``/health``'s latency meanwhile, for the server of a given source tree.

Run it for two trees to compare a change (a ``git worktree`` of the commit before it, and the working tree):
``python -m benchmarks.render_bounds --tree /tmp/before`` then ``--tree .``. Per body: the answer's status, its
time (median of the rounds), and ``/health``'s worst latency while two clients post it at once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx

from benchmarks._common import bench_model, health_during, server

EMPTY = {"role": "user", "content": ""}
TURN = {"role": "user", "content": "x"}
BODIES = {
    "report: 120k empty chat messages": ("/v1/chat/completions", {"messages": [EMPTY] * 120_000, "max_tokens": 1}),
    "report: 100k Messages turns": ("/v1/messages", {"model": "default", "max_tokens": 1,
                                                     "messages": [EMPTY] * 100_000}),
    "report: 100k Responses items": ("/v1/responses", {"input": [EMPTY] * 100_000, "max_output_tokens": 1}),
    "report: 350k objects in custom_tools": ("/v1/chat/completions", {
        "messages": [TURN], "max_tokens": 1, "chat_template_kwargs": {"custom_tools": [{}] * 350_000}}),
    "bound: 10k chat messages": ("/v1/chat/completions", {"messages": [TURN] * 10_000, "max_tokens": 1}),
    "bound: 10k Messages turns": ("/v1/messages", {"model": "default", "max_tokens": 1,
                                                   "messages": [TURN] * 10_000}),
    "bound: 10k Responses items": ("/v1/responses", {"input": [TURN] * 10_000, "max_output_tokens": 1}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=Path("."), help="the source tree whose server is measured")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = bench_model(hidden=64, layers=2, name="large-bodies")
    tree = args.tree.resolve()
    print(f"{tree}")
    print("| body | status | seconds | /health worst (s) |")
    print("|---|---|---|---|")
    with server(model, "--max-body-bytes", str(8 << 20), tree=tree) as url, \
            httpx.Client(base_url=url, timeout=600) as client:
        for name, (path, body) in BODIES.items():
            raw = json.dumps(body, separators=(",", ":")).encode()
            times, statuses, worst = [], set(), 0.0
            for _ in range(args.rounds):
                def post(raw: bytes = raw, path: str = path, times: list[float] = times,
                         statuses: set[int] = statuses) -> None:
                    started = time.perf_counter()
                    answer = client.post(path, content=raw, headers={"Content-Type": "application/json"})
                    times.append(time.perf_counter() - started)
                    statuses.add(answer.status_code)

                worst = max(worst, max(health_during(url, post, threads=2, interval=0.01), default=0.0))
            print(f"| {name} | {'/'.join(map(str, sorted(statuses)))} | {statistics.median(times):.2f} | "
                  f"{worst:.2f} |")


if __name__ == "__main__":
    main()
