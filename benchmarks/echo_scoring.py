"""A stream's longest pause while another request's long prompt is scored (``echo`` with ``logprobs``).

The reliability report's case: ``echo`` with ``logprobs`` on a 1,900-token prompt paused every other stream
2.0 s (a plain prefill of it: 0.83 s). For each tree (a ``git worktree`` of the commit before a change, and
``.``) this starts ``mlxcel serve`` on the same 8 x 512 fp32 llama, opens a stream, and once it decodes posts
the echo request; it prints the stream's median gap between tokens, its longest gap, and the echo request's
own time.

``python -m benchmarks.echo_scoring --trees /tmp/before .``
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import threading
import time
from pathlib import Path

import httpx

from benchmarks._common import bench_model, server, tree_table


def _measure(tree: Path, model: Path, prompt: int, stream_tokens: int) -> tuple[float, float, float]:
    """(median gap, longest gap, the echo's seconds) with the echo sent beside the stream."""
    echo = {"prompt": [(37 * i) % 500 + 3 for i in range(prompt)], "max_tokens": 1, "temperature": 0,
            "logprobs": 1, "echo": True}
    with server(model, tree=tree) as url, httpx.Client(timeout=600) as client:
        client.post(f"{url}/v1/completions", json=echo).raise_for_status()  # warm: every shape once
        arrivals: list[float] = []
        echo_seconds: list[float] = []

        def post_echo() -> None:
            started = time.perf_counter()
            client.post(f"{url}/v1/completions", json=echo).raise_for_status()
            echo_seconds.append(time.perf_counter() - started)

        sender = threading.Thread(target=post_echo)
        with client.stream("POST", f"{url}/v1/completions", json={
                "prompt": "def wrap(text, width=70):", "max_tokens": stream_tokens, "temperature": 0,
                "stream": True, "logit_bias": {"2": -100}}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.perf_counter())
                    if len(arrivals) == 20:
                        sender.start()
        sender.join()
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return statistics.median(gaps), max(gaps), echo_seconds[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trees", type=Path, nargs="+", default=[Path(".")])
    parser.add_argument("--prompt", type=int, default=1900, help="the echoed prompt's tokens")
    parser.add_argument("--stream-tokens", type=int, default=600)
    args = parser.parse_args()
    model = bench_model(hidden=512, layers=8)

    def row(tree: Path) -> list[str]:
        median, longest, echo = _measure(tree, model, args.prompt, args.stream_tokens)
        return [f"{median * 1000:.1f} ms", f"{longest:.3f} s", f"{echo:.2f} s"]

    tree_table(args.trees, ["stream: median gap", "stream: longest gap", "echo request"], row)

if __name__ == "__main__":
    main()
