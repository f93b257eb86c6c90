"""Shared by the benchmarks: a model to measure, a real server to measure it through, statistics.

Run every benchmark from the repository root as a module (``python -m benchmarks.NAME``):
each one measures both sides of its comparison in the same run and prints the ratio,
because on shared, noisy machines a ratio measured side by side is the only number
that means anything.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / ".bench"
NOTES_SCHEMA = {"type": "object", "properties": {"title": {"type": "string"},
                                                 "notes": {"type": "array", "items": {"type": "string"}}},
                "required": ["title", "notes"], "additionalProperties": False}
"""The constrained-decoding benchmarks' JSON schema: room for a long answer (a random model fills the
strings until max_tokens)."""


def add_model_arguments(parser: argparse.ArgumentParser, rounds: int, tokens: int) -> None:
    """The options every serving benchmark takes: rounds, tokens, and the benchmark model's size."""
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--tokens", type=int, default=tokens)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)


def bench_model(family: str = "llama", hidden: int = 512, layers: int = 8, name: str | None = None) -> Path:
    """A random-weight fp32 checkpoint big enough that a decode step is milliseconds, not microseconds."""
    from mlxcel.testing.checkpoints import build_checkpoint

    directory = BENCH_DIR / (name or f"{family}-h{hidden}-l{layers}")
    if (directory / "model.safetensors").exists():
        return directory
    return build_checkpoint(directory, family, scale=2.0, hidden_size=hidden, num_hidden_layers=layers,
                            intermediate_size=hidden * 3, num_attention_heads=hidden // 64,
                            num_key_value_heads=max(1, hidden // 256), head_dim=64)


def context_window(tokens: int, floor: int = 0, slack: int = 256) -> int:
    """The context window (a power of two, at least *floor*) of a benchmark model that must hold *tokens*
    tokens of prompt and completion, with *slack* to spare (a chat template, a prompt's own words)."""
    return max(floor, 1 << (tokens + slack).bit_length())


def context_model(family: str, hidden: int, layers: int, context: int) -> Path:
    """A random-weight fp32 *family* checkpoint (``llama``, or ``qwen3_5`` with every fourth layer full attention)
    whose context window is *context* positions: the long-prompt benchmarks' model."""
    from mlxcel.testing.checkpoints import CONFIGS, build_checkpoint

    directory = BENCH_DIR / f"context-{family}-h{hidden}-l{layers}-c{context}"
    if (directory / "model.safetensors").exists():
        return directory
    shape = {"hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": hidden * 3,
             "num_attention_heads": hidden // 64, "num_key_value_heads": max(1, hidden // 256), "head_dim": 64,
             "max_position_embeddings": context}
    if family == "qwen3_5":  # the shape lives in its text_config
        text = {**CONFIGS["qwen3_5"]["text_config"], **shape, "full_attention_interval": 4,
                "linear_num_value_heads": hidden // 64, "linear_num_key_heads": hidden // 128,
                "linear_key_head_dim": 64, "linear_value_head_dim": 64}
        return build_checkpoint(directory, family, scale=2.0, text_config=text)
    return build_checkpoint(directory, family, scale=2.0, **shape)


def mtp_model(drafter: str, context_scale: float, layers: int = 12, hidden: int = 256, positions: int = 4096,
              released: bool = False) -> Path:
    """A Qwen 3.5 target with an in-checkpoint MTP head of chosen quality (see mlxcel/families/qwen3_5/tiny.py),
    whose context window is *positions*; *released*: its layers shaped as Qwen3.5-0.8B's (hidden 1024, whatever
    *hidden* says)."""
    from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint

    hidden = 1024 if released else hidden
    window = "" if positions == 4096 else f"-c{positions}"
    shapes = "-08b" if released else ""
    directory = BENCH_DIR / f"qwen35-{drafter}-{context_scale}-l{layers}-h{hidden}{shapes}{window}"
    if not (directory / "model.safetensors").exists():
        build_mtp_checkpoint(directory, drafter=drafter, context_scale=context_scale, layers=layers, hidden=hidden,
                             positions=positions, released=released)
    return directory


WORDS = ("file", "def", "return", "value", "error", "test", "line", "the", "path", "import", "class", "self",
         "config", "result", "None", "check", "buffer", "index", "module", "patch", "diff", "output", "read")


def words(tokenizer: Any, tokens: int, rng: random.Random) -> str:
    """Random code-ish words that *tokenizer* (a transformers tokenizer) reads as *tokens* tokens, within a
    word's."""
    text: list[str] = []
    while (count := len(tokenizer.encode(" ".join(text), add_special_tokens=False))) < tokens:
        per_word = count / len(text) if text else 3.0
        text += [rng.choice(WORDS) for _ in range(max(1, int((tokens - count) / per_word / 2)))]
    return " ".join(text)


def complete(client: httpx.Client, url: str, prompt: str | list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    """A greedy completion (with *extra* request fields); its body."""
    response = client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                            "temperature": 0, **extra})
    response.raise_for_status()
    body: dict[str, Any] = response.json()
    return body


def decode_rate(bodies: dict[str, Any] | list[dict[str, Any]]) -> float:
    """The server's own decode rate over one or more completions: their tokens / their decode time.

    Pooled, not a median of per-completion rates: a completion that ends at
    once (end of sequence first) adds nothing instead of a rate of zero.
    """
    timings = [b["timings"] for b in (bodies if isinstance(bodies, list) else [bodies])]
    return float(sum(t["predicted_n"] for t in timings) / (sum(t["predicted_ms"] for t in timings) / 1000))


def compact_memory() -> str:
    """Drop the page cache and compact free memory (Linux, root only), so that servers started one after another
    get memory alike; what was done, for the benchmark's header.

    Measured (2026-12-05, docs/benchmarks.md): three identical servers started in turn on a machine whose memory
    earlier runs had churned decoded 3-5% slower the earlier each was started; after this, within 2%, in no order.
    """
    try:
        subprocess.run(["sync"], check=False)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        Path("/proc/sys/vm/compact_memory").write_text("1\n")
    except OSError as exc:
        return f"not compacted ({exc.strerror}): servers started earlier may run a few per cent slower"
    return "page cache dropped, free memory compacted"


#: Each ``mlxcel serve`` that :func:`server` started in this process: its URL's log (``benchmarks/_step_log.py``).
SERVER_LOGS: dict[str, Path] = {}


@contextmanager
def server(model: Path, *args: str, env: dict[str, str] | None = None, tree: Path | None = None) -> Iterator[str]:
    """`mlxcel serve` in a subprocess (the tests' helper); yields its URL once healthy, then SIGTERM.

    *tree*: serve that source tree's mlxcel (a ``git worktree`` of another commit), not this one's."""
    from mlxcel.testing.serving import serve_subprocess

    BENCH_DIR.mkdir(exist_ok=True)
    log = BENCH_DIR / f"serve-{time.time_ns()}.log"
    where = {"PYTHONPATH": str(tree.resolve())} if tree is not None else {}
    # Benchmark models are big: loading and the exactness probe at boot take minutes on a slow BLAS.
    with serve_subprocess(["--model", str(model), *args], {**where, **(env or {})}, log, start_timeout=900,
                          cwd=tree.resolve() if tree is not None else None) as url:
        SERVER_LOGS[url] = log
        yield url


@contextmanager
def mlx_lm_server(path: Path, *args: str, module: str = "mlx_lm.server") -> Iterator[str]:
    """``mlx_lm.server`` (or another such *module*: ``mlx_vlm.server``) on *path*, with this process's BLAS choice
    (``MLXCEL_BLAS``) loaded before mlx."""
    from mlxcel.testing.serving import free_port, wait_healthy

    port = free_port()
    code = ("import runpy, sys; from mlxcel.blas import load_fast_blas; load_fast_blas(); "
            f"sys.argv = ['{module}', *sys.argv[1:]]; runpy.run_module('{module}', run_name='__main__')")
    log = BENCH_DIR / f"{module.replace('.', '-')}-{time.time_ns()}.log"
    with log.open("w") as out, subprocess.Popen([sys.executable, "-c", code, "--model", str(path), "--port",
                                                 str(port), *args], stdout=out, stderr=subprocess.STDOUT) as process:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, process, 900, log)  # big models load for minutes
            yield url
        finally:
            process.terminate()
            process.wait(timeout=60)


def peak_mb(url: str) -> float:
    """The server's peak resident memory (VmHWM), from the pid its /props reports (``--props``)."""
    return _memory_mb(url, "VmHWM:")


def resident_mb(url: str) -> float:
    """The server's resident memory now (VmRSS), from the pid its /props reports (``--props``)."""
    return _memory_mb(url, "VmRSS:")


def _memory_mb(url: str, field: str) -> float:
    pid = httpx.get(f"{url}/props").json()["pid"]
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    return float("nan")


def health_during(url: str, work: Callable[[], None], threads: int, interval: float) -> list[float]:
    """``/health``'s latencies, polled every *interval* seconds while *threads* threads each run *work*."""
    latencies: list[float] = []
    done = threading.Event()

    def poll() -> None:
        with httpx.Client(timeout=600) as client:
            while not done.is_set():
                started = time.perf_counter()
                client.get(f"{url}/health")
                latencies.append(time.perf_counter() - started)
                time.sleep(interval)

    poller = threading.Thread(target=poll)
    poller.start()
    workers = [threading.Thread(target=work) for _ in range(threads)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    done.set()
    poller.join()
    return latencies


def stream_decode_rate(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> float:
    """Decode tokens/s of one streamed greedy completion, as its client sees it.

    (tokens - 1) / (time of the last chunk - time of the first text chunk); the
    token count is the server's own ``timings.predicted_n``.
    """
    first = last = None
    tokens = 0
    with client.stream("POST", f"{url}/v1/completions", json={
            "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                first = now
            if "timings" in chunk:
                last, tokens = now, chunk["timings"]["predicted_n"]
    if first is None or last is None or tokens < 2:
        raise RuntimeError("the stream produced too few tokens to time")
    return (tokens - 1) / (last - first)


def tree_table(trees: list[Path], columns: list[str], measure: Callable[[Path], list[str]]) -> None:
    """A markdown table with a row per source tree (a ``git worktree`` of another commit, or ``.``), its cells
    ``measure(tree)``, each row printed as soon as it is measured."""
    print("| tree | " + " | ".join(columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for tree in trees:
        print(f"| {tree} | " + " | ".join(measure(tree.resolve())) + " |", flush=True)


def interleaved_ms(sides: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median milliseconds of each MLX side (a function returning what to evaluate), warmed once, then
    run in turns so that the machine's drift falls on every side alike."""
    import mlx.core as mx

    runs: dict[str, list[float]] = {name: [] for name in sides}
    for side in sides.values():
        mx.eval(side())
    for _ in range(repeats):
        for name, side in sides.items():
            started = time.perf_counter()
            mx.eval(side())
            runs[name].append(time.perf_counter() - started)
    return {name: 1e3 * statistics.median(values) for name, values in runs.items()}


def median(values: list[float]) -> float:
    return statistics.median(values)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def best_of(setup: Callable[[], Any], run: Callable[[Any], Any], repeats: int) -> float:
    """The least seconds of *repeats* runs of *run* on a fresh ``setup()`` each, its result evaluated (mlx)."""
    import mlx.core as mx

    times = []
    for _ in range(repeats):
        state = setup()
        started = time.perf_counter()
        mx.eval(run(state))
        times.append(time.perf_counter() - started)
    return min(times)
