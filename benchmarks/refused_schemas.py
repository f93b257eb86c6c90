"""``/health`` and resident memory while 20 clients post large schemas, for the servers of two source trees.

The reliability report's case: 20 large schemas at once (all rightly refused) made ``/health`` take 2.1-2.4 s,
and resident memory rose 388 -> 1,186 MB over 80 of them and stayed. For each tree (a ``git worktree`` of the
commit before a change, and ``.``) this starts ``mlxcel serve`` on the bundled model and, with ``/health``
polled every 50 ms, has 20 clients post 4 chat requests each whose ``response_format`` is one of:

- ``deep``: 2,000 properties and one 200 levels deep (about 94 KB): refused by the depth bound;
- ``wide``: 1,500 string properties (about 60 KB): compiled by llguidance, refused at its first mask.

A stream decodes meanwhile (400-token completions back to back). It prints the answers, ``/health``'s
median, 99th percentile and longest time, the stream's median and longest gap between tokens, and the
server's resident memory before and after (Linux: ``/proc`` of the pid ``/props`` reports).

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

from benchmarks._common import health_during, resident_mb, server, tree_table

CLIENTS, ROUNDS = 20, 4


def _schema(kind: str) -> dict[str, Any]:
    if kind == "wide":
        return {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(1500)}}
    deep: dict[str, Any] = {"type": "string"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}}
    return {"type": "object", "properties": {**{f"f{i}": {"type": "string"} for i in range(2000)}, "deep": deep}}


def _measure(tree: Path, model: Path, kind: str) -> list[str]:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": _schema(kind)}}}
    with server(model, "--props", tree=tree) as url:
        before = resident_mb(url)
        answers: collections.Counter[int] = collections.Counter()

        def client() -> None:
            with httpx.Client(timeout=600) as http:
                for _ in range(ROUNDS):
                    answers[http.post(f"{url}/v1/chat/completions", json=body).status_code] += 1

        gaps: list[float] = []
        posting = threading.Event()
        streaming = threading.Thread(target=_stream_gaps, args=(url, posting, gaps))
        posting.set()
        streaming.start()
        health = health_during(url, client, threads=CLIENTS, interval=0.05)
        posting.clear()
        streaming.join()
        after = resident_mb(url)
    health.sort()
    return [str(dict(answers)), f"{statistics.median(health) * 1000:.0f} ms",
            f"{health[int(len(health) * 0.99)] * 1000:.0f} ms", f"{health[-1]:.2f} s",
            f"{statistics.median(gaps) * 1000:.0f} ms", f"{max(gaps):.2f} s", f"{before:.0f} -> {after:.0f} MB"]


def _stream_gaps(url: str, posting: threading.Event, gaps: list[float]) -> None:
    """Stream completions back to back while *posting* is set; the gaps between their tokens into *gaps*."""
    with httpx.Client(timeout=600) as http:
        while posting.is_set():
            last = None
            with http.stream("POST", f"{url}/v1/completions", json={"prompt": "def", "max_tokens": 400,
                                                                    "temperature": 0, "stream": True}) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        now = time.perf_counter()
                        if last is not None:
                            gaps.append(now - last)
                        last = now
                    if not posting.is_set():
                        break


def main() -> None:
    from mlxcel.serve_cli import BUNDLED_MODEL

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trees", type=Path, nargs="+", default=[Path(".")])
    parser.add_argument("--kinds", nargs="+", default=["deep", "wide"], choices=["deep", "wide"])
    args = parser.parse_args()
    for kind in args.kinds:
        print(f"\n{kind}:\n")
        tree_table(args.trees, ["answers", "/health median", "p99", "longest", "a stream's median gap",
                                "its longest gap", "resident memory"],
                   lambda tree, kind=kind: _measure(tree, BUNDLED_MODEL, kind))


if __name__ == "__main__":
    main()
