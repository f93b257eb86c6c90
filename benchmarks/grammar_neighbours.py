"""What a costly grammar does to the streams beside it: their time between tokens, alone and next to one.

    python -m benchmarks.grammar_neighbours [--streams 3] [--tokens 48] [--rounds 3] [--hidden 512 --layers 8]

One server (``--parallel streams + 4``). Per round and per shape, the plain
streams (``--streams`` chat completions, streamed, temperature 0) run twice:
alone, and beside one request constrained by the shape with ``n: 4`` (four
sequences masking every step, as the report's attack). A stream's time
between tokens is the median gap between its content chunks; printed per shape:
the status the constrained request got (a refused one holds nothing), the
neighbours' median gap alone and beside it, and the ratio (the issue's bound:
within 2x). The shapes: those the report found accepted and costly (now
refused), and the costliest that the bounds accept (one pattern or literal at
the per-part bound; many parts at the schema's bound).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import httpx  # noqa: E402

from benchmarks._common import add_model_arguments, bench_model, median, server  # noqa: E402
from mlxcel.server.schema_bounds import MAX_PATTERN_COST, MAX_SCHEMA_COST  # noqa: E402

PARTS = MAX_SCHEMA_COST // MAX_PATTERN_COST
SHAPES: dict[str, dict[str, Any]] = {
    "reported: a{1000} x 256 in one pattern": {"type": "string", "pattern": "^" + "a{1000}" * 256 + "$"},
    "reported: a 65,535-character literal": {"type": "string", "pattern": "^" + "a" * 65535 + "$"},
    "reported: 300 properties each ^a{1000}$": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^a{1000}$"} for i in range(300)},
        "required": [f"p{i}" for i in range(300)]},
    f"accepted: ^a{{{MAX_PATTERN_COST}}}$": {"type": "string", "pattern": f"^a{{{MAX_PATTERN_COST}}}$"},
    f"accepted: ^a{{{MAX_PATTERN_COST // 2}}}b{{{MAX_PATTERN_COST // 2}}}$": {
        "type": "string", "pattern": f"^a{{{MAX_PATTERN_COST // 2}}}b{{{MAX_PATTERN_COST // 2}}}$"},
    f"accepted: a {MAX_PATTERN_COST}-character const": {"const": "a" * MAX_PATTERN_COST},
    f"accepted: anyOf {PARTS} patterns of {MAX_PATTERN_COST}": {"anyOf": [
        {"type": "string", "pattern": f"^{chr(97 + i % 26)}{chr(97 + i // 26)}{{{MAX_PATTERN_COST - 1}}}$"}
        for i in range(PARTS)]},
    f"accepted: {PARTS} required properties of {MAX_PATTERN_COST}": {
        "type": "object", "properties": {f"p{i}": {"type": "string", "pattern": f"^a{{{MAX_PATTERN_COST}}}$"}
                                         for i in range(PARTS)}, "required": [f"p{i}" for i in range(PARTS)]},
}
QUESTIONS = ["Write a story about a lighthouse.", "List some colours.", "Explain recursion.", "Describe rain."]


def _gaps(client: httpx.Client, url: str, question: str, tokens: int) -> list[float]:
    """The gaps between one streamed answer's content chunks, in seconds."""
    arrivals = []
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": tokens, "temperature": 0,
            "stream": True}
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(arrivals)]


def _constrained(client: httpx.Client, url: str, schema: dict[str, Any], tokens: int) -> int:
    body = {"messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": tokens, "n": 4,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}
    return client.post(f"{url}/v1/chat/completions", json=body).status_code


def _neighbours(client: httpx.Client, pool: ThreadPoolExecutor, url: str, streams: int, tokens: int,
                schema: dict[str, Any] | None) -> tuple[float, int | None]:
    """The plain streams' median gap (ms), with the constrained request beside them if *schema*, and its status."""
    beside = pool.submit(_constrained, client, url, schema, tokens * 4) if schema is not None else None
    if beside is not None:
        time.sleep(0.3)  # admitted and masking before the streams start
    gaps = list(pool.map(lambda q: _gaps(client, url, q, tokens), [QUESTIONS[i % 4] for i in range(streams)]))
    status = beside.result() if beside is not None else None
    return median([g for stream in gaps for g in stream]) * 1e3, status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=3)
    add_model_arguments(parser, rounds=3, tokens=48)
    args = parser.parse_args()
    model = bench_model("llama", args.hidden, args.layers)
    alone: dict[str, list[float]] = {name: [] for name in SHAPES}
    beside: dict[str, list[float]] = {name: [] for name in SHAPES}
    status: dict[str, int | None] = {}
    with server(model, "--parallel", str(args.streams + 4)) as url, httpx.Client(timeout=600) as client, \
            ThreadPoolExecutor(args.streams + 1) as pool:
        _neighbours(client, pool, url, args.streams, 8, {"type": "string"})  # warm up both paths
        for _ in range(args.rounds):
            for name, schema in SHAPES.items():
                alone[name].append(_neighbours(client, pool, url, args.streams, args.tokens, None)[0])
                gap, status[name] = _neighbours(client, pool, url, args.streams, args.tokens, schema)
                beside[name].append(gap)
    print(f"model {model.name}; {args.streams} plain streams of {args.tokens} tokens beside one n: 4 request; "
          f"{args.rounds} rounds")
    print("| shape | its status | neighbours alone (ms between tokens) | beside it | ratio |")
    print("|---|---|---|---|---|")
    for name in SHAPES:
        ratios = [b / a for a, b in zip(alone[name], beside[name], strict=True)]
        print(f"| {name} | {status[name]} | {median(alone[name]):.1f} | {median(beside[name]):.1f} | "
              f"{median(ratios):.2f} |")


if __name__ == "__main__":
    main()
