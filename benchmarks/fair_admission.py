"""A short request's wait beside a request of ``n`` long choices, for the servers of two source trees.

The reliability report's case: ``n=16`` with ``max_tokens`` 1,900 streaming on the default 4 places, then
another client's 32-token request; its time to first token was 70 s (0.056 s alone). For each tree (a
``git worktree`` of the commit before a change, and ``.``) this starts ``mlxcel serve`` on the same
8 x 512 fp32 llama, opens the ``n`` stream, waits for its first token and a second more, sends the
short request, and prints its time to first token and to its end, then closes the ``n`` stream.

``python -m benchmarks.fair_admission --trees /tmp/before .``
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import httpx

from benchmarks._common import bench_model, server, tree_table


def _short_request(url: str, tokens: int) -> tuple[float, float]:
    """(seconds to the first token, seconds to the end) of a streamed *tokens*-token completion."""
    started = time.perf_counter()
    first = None
    with httpx.Client(timeout=600) as client, client.stream("POST", f"{url}/v1/completions", json={
            "prompt": "x", "max_tokens": tokens, "temperature": 0, "stream": True}) as response:
        for line in response.iter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - started
    return first or float("nan"), time.perf_counter() - started


def _measure(tree: Path, model: Path, n: int, max_tokens: int, short: int) -> tuple[float, float, float]:
    with server(model, tree=tree) as url:
        alone = _short_request(url, short)[0]
        first_token = threading.Event()
        done = threading.Event()

        def many() -> None:
            body = {"prompt": "def wrap(text, width=70):", "max_tokens": max_tokens, "n": n, "stream": True,
                    "temperature": 1.0, "seed": 7}
            with httpx.Client(timeout=600) as client, client.stream("POST", f"{url}/v1/completions",
                                                                    json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {") and any(c.get("text") for c in json.loads(line[6:])["choices"]):
                        first_token.set()
                    if done.is_set():
                        return  # closing the stream cancels the choices

        thread = threading.Thread(target=many)
        thread.start()
        first_token.wait(300)
        time.sleep(1.0)
        beside, end = _short_request(url, short)
        done.set()
        thread.join()
        return alone, beside, end


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trees", type=Path, nargs="+", default=[Path(".")])
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=1900)
    parser.add_argument("--short", type=int, default=32)
    args = parser.parse_args()
    model = bench_model(hidden=512, layers=8)

    def row(tree: Path) -> list[str]:
        alone, beside, end = _measure(tree, model, args.n, args.max_tokens, args.short)
        return [f"{alone:.3f} s", f"{beside:.3f} s", f"{end:.3f} s"]

    tree_table(args.trees, ["short alone: first token", "beside n: first token", "beside n: end"], row)

if __name__ == "__main__":
    main()
