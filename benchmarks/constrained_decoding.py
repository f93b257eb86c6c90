"""The cost of constrained decoding: decode tokens/s with and without a JSON schema, B=1 and batched.

    python -m benchmarks.constrained_decoding [--batch 4] [--tokens 64] [--rounds 6] [--hidden 512 --layers 8]

One server, one run. Each pass measures, at B=1 and then with ``--batch``
requests at once, the two sides in the order free, schema, schema, free
(so a drift of the shared machine's load within a pass weighs on both sides
alike); the schema side is ``response_format: json_schema`` (llguidance's
mask at every step, and a read-back of each sampled token the mask needs).
The rate is the server's own ``timings`` (generated tokens / decode time,
pooled over the requests). Per pass, the ratio schema / free; printed: the
median of those paired ratios, the median rates, and the step time of the
free side (the bench model is sized so that a step is 10-20 ms: on a tiny
model the mask's fixed cost would be all there is to see).
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


def _pass(client: httpx.Client, pool: ThreadPoolExecutor, url: str, prompts: list[str],
          tokens: int) -> dict[tuple[int, bool], list[dict[str, Any]]]:
    """One pass: per batch size, the free side, the schema side twice, the free side again."""
    bodies: dict[tuple[int, bool], list[dict[str, Any]]] = {}
    for batch in (1, len(prompts)):
        for constrained in (False, True, True, False):
            measured = list(pool.map(lambda p, c=constrained: one(client, url, p, tokens, c), prompts[:batch]))
            bodies.setdefault((batch, constrained), []).extend(measured)
    return bodies


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=4)
    add_model_arguments(parser, rounds=6, tokens=64)
    args = parser.parse_args()
    model = bench_model("llama", args.hidden, args.layers)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]
    print(f"model: {model.name}, {args.tokens} tokens, batch {args.batch}, {args.rounds} passes")
    sizes = (1, args.batch)
    rates: dict[tuple[int, bool], list[float]] = {(b, c): [] for b in sizes for c in (False, True)}
    counts: dict[tuple[int, bool], list[int]] = {key: [] for key in rates}
    with server(model, "--parallel", str(args.batch)) as url, httpx.Client(timeout=600) as client, \
            ThreadPoolExecutor(args.batch) as pool:
        for constrained in (False, True):  # warm up both paths (llguidance's tokenizer is built on first use)
            one(client, url, "warm up", 8, constrained)
        for _ in range(args.rounds):
            for key, bodies in _pass(client, pool, url, prompts, args.tokens).items():
                rates[key].append(decode_rate(bodies))
                counts[key] += [b["usage"]["completion_tokens"] for b in bodies]
    for batch in sizes:
        free, schema = rates[batch, False], rates[batch, True]
        paired = [s / f for s, f in zip(schema, free, strict=True)]
        lengths = {c: median([float(t) for t in counts[batch, c]]) for c in (False, True)}
        # A request's rate in the batch is one token per batch step: the step time is 1 / rate either way.
        print(f"B={batch}: ratio schema / free {median(paired):.2f} (per pass {[round(r, 2) for r in paired]}); "
              f"free {median(free):.1f} tok/s (step {1000 / median(free):.1f} ms), schema {median(schema):.1f} "
              f"tok/s; tokens per request: free {lengths[False]:.0f}, schema {lengths[True]:.0f}")


if __name__ == "__main__":
    main()
