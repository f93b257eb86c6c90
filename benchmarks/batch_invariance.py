"""What it costs that a row's bytes are its own, and whether they are: the servers of two source trees.

    python -m benchmarks.batch_invariance --trees /tmp/before . [--layers 24 --hidden 1024] [--streams 8]
        [--tokens 64] [--prompt-tokens 300] [--rounds 3] [--prompt-cache]

For each tree (a ``git worktree`` of the commit before a change, and ``.``) this starts ``mlxcel serve
--parallel STREAMS`` (no MTP; the prompt cache off, so that every prompt is prefilled as it arrives, unless
``--prompt-cache``: then rounds after the first find their prompts cached, as an agent's resent prompts are,
and the decode steps dominate) on one fp32 Qwen 3.5 of the MTP benchmarks (``benchmarks/_common.mtp_model``)
and, each round:

- sends STREAMS requests at once, each a different prompt of about PROMPT_TOKENS tokens and TOKENS greedy
  tokens: aggregate tokens/s from the first byte sent to the last answer (prefill, decode and admission
  together), the mean and the longest time to first token (streamed);
- asks one more request with ``logprobs``, alone, then again with the STREAMS others sent beside it, and says
  whether its log-probabilities were the same floats ("yes" in every round: its bytes are its own).

Prints a markdown row per tree, medians over the rounds; the ratio of two trees' rates is the cost.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import httpx  # noqa: E402

from benchmarks._common import mtp_model, server, tree_table, words  # noqa: E402


def _streamed(url: str, prompt: str, tokens: int) -> tuple[float, int]:
    """(seconds to the first token, tokens generated) of one streamed greedy completion."""
    started, first, count = time.perf_counter(), None, 0
    with httpx.Client(timeout=900) as client, client.stream("POST", f"{url}/v1/completions", json={
            "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and any(c.get("text") for c in chunk.get("choices", [])):
                first = time.perf_counter() - started
            if chunk.get("usage"):
                count = int(chunk["usage"]["completion_tokens"])
    return first if first is not None else float("nan"), count


def _logprobs(url: str, prompt: str, tokens: int) -> Any:
    with httpx.Client(timeout=900) as client:
        body = client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": tokens,
                                                           "temperature": 0, "logprobs": 2}).json()
    return body["choices"][0]["logprobs"]


def _round(url: str, prompts: list[str], probe: str, tokens: int) -> tuple[float, float, float, bool]:
    with ThreadPoolExecutor(len(prompts) + 1) as pool:
        started = time.perf_counter()
        results = list(pool.map(lambda p: _streamed(url, p, tokens), prompts))
        rate = sum(count for _, count in results) / (time.perf_counter() - started)
        alone = _logprobs(url, probe, tokens)
        beside = pool.submit(_logprobs, url, probe, tokens)
        list(pool.map(lambda p: _streamed(url, p, tokens), prompts))
        same = beside.result() == alone
    firsts = [first for first, _ in results]
    return rate, statistics.mean(firsts), max(firsts), same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trees", type=Path, nargs="+", default=[Path(".")])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt-cache", action="store_true")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    model = mtp_model("aligned", 0.0, args.layers, args.hidden)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    rng = random.Random(0)
    prompts = [words(tokenizer, args.prompt_tokens, rng) for _ in range(args.streams)]
    probe = words(tokenizer, args.prompt_tokens // 3, rng)
    print(f"model: {model.name}, {args.streams} streams x ~{args.prompt_tokens} prompt tokens x {args.tokens} "
          f"tokens, {args.rounds} rounds")

    def row(tree: Path) -> list[str]:
        cache = [] if args.prompt_cache else ["--prompt-cache-size", "0", "--prompt-cache-disk-bytes", "0"]
        with server(model, "--parallel", str(args.streams), *cache, tree=tree) as url:
            _streamed(url, "warm up", 4)
            runs = [_round(url, prompts, probe, args.tokens) for _ in range(args.rounds)]
        rates, means, longest, same = zip(*runs, strict=True)
        return [f"{statistics.median(rates):.2f}", f"{statistics.median(means):.2f} s",
                f"{statistics.median(longest):.2f} s", "yes" if all(same) else f"no ({sum(same)}/{len(same)})"]

    tree_table(args.trees, ["aggregate tok/s", "mean first token", "last first token",
                            "logprobs alone = beside others"], row)


if __name__ == "__main__":
    main()
