"""``/health`` and resident memory while 20 clients post large schemas, for the servers of two source trees.

The reliability report's case: 20 large schemas at once (all rightly refused) made ``/health`` take 2.1-2.4 s,
and resident memory rose 388 -> 1,186 MB over 80 of them and stayed. For each tree (a ``git worktree`` of the
commit before a change, and ``.``) this starts ``mlxcel serve`` on the bundled model and, with ``/health``
polled every 50 ms, has 20 clients post 4 chat requests each whose ``response_format`` is one of:

- ``deep``: 2,000 properties and one 200 levels deep (about 94 KB): refused by the depth bound;
- ``wide``: 1,500 string properties (about 60 KB): compiled by llguidance, refused at its first mask.

It prints the answers, ``/health``'s median, 99th percentile and longest time, and the server's resident
memory before and after (Linux: read from ``/proc``).

``python -m benchmarks.refused_schemas --trees /tmp/before .``
"""

from __future__ import annotations

import argparse
import collections
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks._common import server

CLIENTS, ROUNDS = 20, 4


def _schema(kind: str) -> dict[str, Any]:
    if kind == "wide":
        return {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(1500)}}
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}}
    return {"type": "object", "properties": {**{f"f{i}": {"type": "string"} for i in range(2000)}, "deep": deep}}


def _resident_mb(port: str) -> float:
    """The resident memory of the process serving *port* (found by its command line), in MB."""
    for proc in Path("/proc").iterdir():
        try:
            command = (proc / "cmdline").read_bytes().split(b"\0")
            status = (proc / "status").read_text()
        except OSError:
            continue
        if b"serve" in command and port.encode() in command:
            return int(status.split("VmRSS:")[1].split()[0]) / 1024
    return float("nan")


def _measure(tree: Path, model: Path, kind: str) -> str:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": _schema(kind)}}}
    with server(model, tree=tree) as url:
        port = url.rsplit(":", 1)[1]
        before = _resident_mb(port)
        answers: collections.Counter[int] = collections.Counter()
        health: list[float] = []
        done = threading.Event()

        def client() -> None:
            with httpx.Client(timeout=600) as http:
                for _ in range(ROUNDS):
                    answers[http.post(f"{url}/v1/chat/completions", json=body).status_code] += 1

        def poll() -> None:
            with httpx.Client(timeout=600) as http:
                while not done.is_set():
                    started = time.perf_counter()
                    http.get(f"{url}/health")
                    health.append(time.perf_counter() - started)
                    time.sleep(0.05)

        poller = threading.Thread(target=poll)
        poller.start()
        clients = [threading.Thread(target=client) for _ in range(CLIENTS)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join()
        done.set()
        poller.join()
        after = _resident_mb(port)
    health.sort()
    return (f"| {tree} | {kind} | {dict(answers)} | {statistics.median(health) * 1000:.0f} ms | "
            f"{health[int(len(health) * 0.99)] * 1000:.0f} ms | {health[-1]:.2f} s | {before:.0f} -> {after:.0f} MB |")


def main() -> None:
    from mlxcel.serve_cli import BUNDLED_MODEL

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trees", type=Path, nargs="+", default=[Path(".")])
    parser.add_argument("--kinds", nargs="+", default=["deep", "wide"], choices=["deep", "wide"])
    args = parser.parse_args()
    print("| tree | schema | answers | /health median | p99 | longest | resident memory |")
    print("|---|---|---|---|---|---|---|")
    for kind in args.kinds:
        for tree in args.trees:
            print(_measure(tree.resolve(), BUNDLED_MODEL, kind), flush=True)


if __name__ == "__main__":
    main()
