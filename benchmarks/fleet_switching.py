"""Several models in one server (``--models``): what switching costs, and whether a load slows the others.

    python -m benchmarks.fleet_switching [--hidden 1024 --layers 12] [--tokens 32] [--rounds 3]

Three random-weight llamas of the same size, A pinned, B and C not:

1. ``--max-loaded 1`` (A unpinned here): a request to the model loaded (warm) against the same request to the
   other (a switch: the loaded one unloaded, the other loaded, then the request), alternating; prints the medians
   and the switch's cost over the warm request's.
2. ``--max-loaded 2``: A streams a long completion while B or C (alternately, each unloading the other) loads
   for a request of its own; prints A's inter-token gaps (median, worst) while that model loads (from its request
   until ``/v1/models`` says it is loaded) against a stream with nothing loading beside it, and their ratio.
"""

from __future__ import annotations

import argparse
import itertools
import threading
import time
from pathlib import Path

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import httpx  # noqa: E402

from benchmarks._common import BENCH_DIR, bench_model, median  # noqa: E402
from mlxcel.testing.serving import serve_subprocess  # noqa: E402

PROMPT = "def wrap(text, width=70):"


def models_file(paths: dict[str, Path], pin_a: bool) -> Path:
    file = BENCH_DIR / f"fleet-{'pinned' if pin_a else 'plain'}.toml"
    file.write_text("".join(f'[[models]]\npath = "{path}"\nnames = ["{name}"]\n'
                            f'pin = {str(pin_a and name == "a").lower()}\n\n' for name, path in paths.items()))
    return file


def request(client: httpx.Client, url: str, model: str, tokens: int) -> float:
    """Seconds for one greedy completion of *tokens* tokens from *model*."""
    start = time.perf_counter()
    response = client.post(f"{url}/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": tokens,
                                                           "temperature": 0})
    response.raise_for_status()
    return time.perf_counter() - start


def stream_gaps(client: httpx.Client, url: str, model: str, tokens: int, beside: str | None,
                marks: dict[str, float]) -> list[float]:
    """A's inter-chunk gaps over one streamed completion; with *beside*, a request to that model is sent (on a
    thread) once the stream has started, and only the gaps while it is in flight are returned."""
    times: list[float] = []
    other: threading.Thread | None = None

    def load() -> None:
        """The other model's request, on its own thread; the marks span its model's load alone (from the
        request to ``/v1/models`` saying it is loaded), not its prefill and decode after."""
        sent = threading.Thread(target=request, args=(httpx.Client(timeout=600), url, beside or "", 4))
        marks["start"] = time.perf_counter()
        sent.start()
        with httpx.Client(timeout=60) as poll:
            while not any(m["id"] == beside and m["state"] == "loaded"
                          for m in poll.get(f"{url}/v1/models").json()["data"]):
                time.sleep(0.01)
        marks["end"] = time.perf_counter()
        sent.join()

    with client.stream("POST", f"{url}/v1/completions", json={
            "model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
                if beside is not None and other is None and len(times) == 4:
                    other = threading.Thread(target=load)
                    other.start()
    if other is not None:
        other.join()
    gaps = [(b, b - a) for a, b in itertools.pairwise(times)]
    if beside is None:
        return [g for _, g in gaps[4:]]
    return [g for t, g in gaps if marks["start"] <= t <= marks["end"]]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    paths = {name: bench_model("llama", args.hidden, args.layers, name=f"fleet-{name}-h{args.hidden}-l{args.layers}")
             for name in ("a", "b", "c")}
    size = sum(f.stat().st_size for f in paths["a"].glob("*.safetensors")) / 1e9
    print(f"three llamas of {size:.2f} GB each (hidden {args.hidden}, {args.layers} layers), {args.tokens} tokens")
    log = BENCH_DIR / f"fleet-{time.time_ns()}.log"
    with serve_subprocess(["--models", str(models_file(paths, False)), "--max-loaded", "1"], {}, log,
                          start_timeout=900) as url, httpx.Client(timeout=600) as client:
        request(client, url, "a", args.tokens)
        warm, switch = [], []
        for round_ in range(args.rounds):
            other = "b" if round_ % 2 == 0 else "a"
            here = "a" if other == "b" else "b"
            warm.append(request(client, url, here, args.tokens))
            switch.append(request(client, url, other, args.tokens))
        print(f"warm request {median(warm):.2f} s, after a switch {median(switch):.2f} s: a switch costs "
              f"{median(switch) - median(warm):.2f} s ({median(switch) / median(warm):.1f}x)")
    log = BENCH_DIR / f"fleet-{time.time_ns()}.log"
    with serve_subprocess(["--models", str(models_file(paths, True)), "--max-loaded", "2"], {}, log,
                          start_timeout=900) as url, httpx.Client(timeout=600) as client:
        request(client, url, "a", args.tokens)
        alone, loading = [], []
        for round_ in range(args.rounds):
            alone += stream_gaps(client, url, "a", args.tokens * 4, None, {})
            marks: dict[str, float] = {}
            loading += stream_gaps(client, url, "a", args.tokens * 4, "b" if round_ % 2 == 0 else "c", marks)
        print(f"A's inter-token gaps: alone median {median(alone) * 1e3:.1f} ms (worst {max(alone) * 1e3:.1f}); "
              f"while another model loads median {median(loading) * 1e3:.1f} ms (worst {max(loading) * 1e3:.1f}, "
              f"{len(loading)} gaps): ratio of medians {median(loading) / median(alone):.2f}")


if __name__ == "__main__":
    main()
