"""B=1 classic decode against the memory-bandwidth ceiling, at realistic sizes, fp32 and 4-bit.

    python -m benchmarks.bandwidth [--sizes 0.5 1 2] [--blas openblas openblas:2 mkl] [--tokens 64] [--rounds 3]

A B=1 decode step reads every weight once (the embedding table aside: one row
of it), so it cannot beat ``read bandwidth / bytes per token``. For each BLAS
(a child process each: mlx resolves its BLAS once, before it loads) and each
model, the rounds interleave: the machine's read bandwidth (numpy sum over 1 GiB,
one thread, as a decode step's matmuls run on one BLAS thread), mlx-lm
``stream_generate``'s decode rate in this process, and two servers' as their
streaming client sees it (:func:`stream_rate`): ``mlxcel serve`` and
``mlx_lm.server``, the latter started with the same BLAS loaded first.
Printed: the ceiling, each side as a fraction of it, mlxcel serve / mlx-lm
``stream_generate`` and mlxcel serve / ``mlx_lm.server``. And the *products*
rate: the model's own linear layers run once each on one row, in one graph,
through mlx (its BLAS, or its quantized kernel): what a step would cost if it
were nothing but its weight products. ceiling / products is how well the
kernel streams these shapes; products / mlxcel is everything else in a step
(norms, RoPE, attention, dispatch), the most ``mx.compile`` could win back.
The models are random-weight llamas (hidden 1024, the layer count chosen for
the size; 4-bit by mlx-lm's own ``convert``), built once into ``.bench/``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPT = "def wrap(text, width=70, **kwargs):"
#: fp32 bytes of one layer of the hidden-1024 llama (attention 2.5 M + MLP 9.4 M parameters).
LAYER_BYTES = 4 * (2 * 1024 * 1024 + 2 * 1024 * 256 + 3 * 1024 * 3072)


def read_bandwidth(buffer: object) -> float:
    """Bytes/s of one thread summing *buffer* (a 1 GiB numpy array): the best of three."""
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        buffer.sum()  # type: ignore[attr-defined]
        best = min(best, time.perf_counter() - start)
    return float(buffer.nbytes) / best  # type: ignore[attr-defined]


def bytes_per_token(model: object) -> int:
    """What one decode step reads: every parameter, less the embedding table when the head is separate."""
    from mlx.utils import tree_flatten

    params = dict(tree_flatten(model.parameters()))  # type: ignore[attr-defined]
    total = sum(v.nbytes for v in params.values())
    if any(name.startswith("lm_head.") for name in params):
        total -= sum(v.nbytes for name, v in params.items() if name.startswith("model.embed_tokens."))
    return total


def products_rate(model: object) -> float:
    """Steps/s of the model's weight products alone: each linear layer (the tied head too) on one row."""
    import mlx.core as mx
    import mlx.nn as nn

    layers = [m for _, m in model.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))]  # type: ignore[attr-defined]
    heads = [] if any(name.endswith("lm_head") for name, _ in model.named_modules()) else [  # type: ignore[attr-defined]
        m for name, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))]  # type: ignore[attr-defined]

    def width(layer: object) -> int:
        weight = layer.weight  # type: ignore[attr-defined]
        bits = getattr(layer, "bits", None)
        return int(weight.shape[1] * 32 // bits) if bits else int(weight.shape[1])

    inputs = [mx.random.normal((1, 1, width(layer))) for layer in layers + heads]
    mx.eval(inputs)

    def once() -> float:
        start = time.perf_counter()
        outputs = [layer(x) for layer, x in zip(layers, inputs, strict=False)]
        outputs += [head.as_linear(x)  # type: ignore[attr-defined]
                    for head, x in zip(heads, inputs[len(layers):], strict=True)]
        mx.eval(outputs)
        return time.perf_counter() - start

    once()
    return 1.0 / min(once() for _ in range(5))


def models(sizes: list[float], bits: list[str]) -> list[Path]:
    from benchmarks._common import BENCH_DIR, bench_model

    found = []
    for size in sizes:
        layers = max(1, round(size * 1e9 / LAYER_BYTES))
        fp32 = bench_model("llama", 1024, layers)
        if "fp32" in bits:
            found.append(fp32)
        if "4bit" in bits:
            quantized = BENCH_DIR / f"{fp32.name}-4bit"
            if not (quantized / "model.safetensors").exists():
                from mlx_lm import convert

                convert(str(fp32), mlx_path=str(quantized), quantize=True, q_bits=4, q_group_size=64)
            found.append(quantized)
    return found


def mlx_lm_rate(loaded: tuple[object, object], max_tokens: int) -> float:
    from mlx_lm import stream_generate

    times = [time.perf_counter() for _ in stream_generate(*loaded, PROMPT, max_tokens=max_tokens)]  # type: ignore[arg-type]
    return (len(times) - 1) / (times[-1] - times[0])


def _streamed(client: object, url: str, tokens: int) -> tuple[int, float]:
    """(completion tokens, seconds from request to last chunk) of one greedy streamed completion."""
    count, started = 0, time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json={  # type: ignore[attr-defined]
            "prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {") and (usage := json.loads(line[6:]).get("usage")):
                count = usage["completion_tokens"]
    return count, time.perf_counter() - started


def stream_rate(client: object, url: str, tokens: int) -> float:
    """Client-observed decode rate: the extra tokens of a *tokens*-long streamed completion over a
    quarter-length one, per extra second. The difference cancels the prompt and the first token, and
    counts tokens, not text chunks: a random model's byte tokens can hold its text back for a dozen
    tokens, so timing from the first text chunk overstates the rate."""
    short, full = _streamed(client, url, max(2, tokens // 4)), _streamed(client, url, tokens)
    if full[0] - short[0] < 2:
        raise RuntimeError(f"{url}: the streams stopped early ({short[0]} and {full[0]} tokens)")
    return (full[0] - short[0]) / (full[1] - short[1])


def measure(paths: list[Path], tokens: int, rounds: int) -> list[dict[str, object]]:
    """This process's BLAS: one row per model (run as the child of :func:`main`)."""
    import httpx
    import numpy as np
    from mlx_lm import load

    from benchmarks._common import median, mlx_lm_server, server

    buffer = np.ones(1 << 28, dtype=np.float32)
    rows = []
    for path in paths:
        loaded = load(str(path))
        per_token = bytes_per_token(loaded[0])
        rates: dict[str, list[float]] = {"bandwidth": [], "products": [], "mlxcel": [], "mlx_lm": [],
                                         "mlx_lm_server": []}
        with server(path, "--parallel", "1") as ours, mlx_lm_server(path) as theirs, \
                httpx.Client(timeout=900) as client:
            stream_rate(client, ours, 16)  # warm up every side
            stream_rate(client, theirs, 16)
            mlx_lm_rate(loaded, 16)
            for _ in range(rounds):
                rates["bandwidth"].append(read_bandwidth(buffer))
                rates["products"].append(products_rate(loaded[0]))
                rates["mlxcel"].append(stream_rate(client, ours, tokens))
                rates["mlx_lm"].append(mlx_lm_rate(loaded, tokens))
                rates["mlx_lm_server"].append(stream_rate(client, theirs, tokens))
        row = {name: median(values) for name, values in rates.items()}
        rows.append({"model": path.name, "gb": per_token / 1e9, **row, "bandwidth": row["bandwidth"] / 1e9,
                     "ceiling": row["bandwidth"] / per_token})
        del loaded
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="fp32 GB")
    parser.add_argument("--bits", nargs="+", default=["fp32", "4bit"], choices=["fp32", "4bit"])
    parser.add_argument("--blas", nargs="+", default=["openblas", "mkl"],
                        help="MLXCEL_BLAS values, each optionally :THREADS (openblas:2)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:  # one BLAS, chosen before mlx loads; rows as JSON on the last line
        from mlxcel.blas import load_fast_blas

        print(f"BLAS: {load_fast_blas()}", file=sys.stderr)
        paths = [Path(p) for p in json.loads(args.child)]
        print(json.dumps(measure(paths, args.tokens, args.rounds)))
        return
    paths = models(args.sizes, args.bits)
    print(f"{'BLAS':<9} {'model':<22} {'GB/token':>8} {'read GB/s':>9} {'ceiling':>8} {'products':>8} "
          f"{'of ceil':>7} {'mlxcel':>7} {'of ceil':>7} {'of prod':>7} {'mlx-lm':>7} {'of ceil':>7} "
          f"{'mlx-lm srv':>10} {'/mlx-lm':>7} {'/mlx-lm srv':>11}")
    for blas in args.blas:
        name, _, threads = blas.partition(":")  # NAME[:THREADS], e.g. openblas:2
        blas_env = {**os.environ, "MLXCEL_BLAS": "auto" if name == "openblas" else name}
        if threads:
            blas_env["MKL_NUM_THREADS" if name == "mkl" else "OPENBLAS_NUM_THREADS"] = threads
        child = subprocess.run([sys.executable, "-m", "benchmarks.bandwidth", "--child", json.dumps(
            [str(p) for p in paths]), "--tokens", str(args.tokens), "--rounds", str(args.rounds)],
            env=blas_env, capture_output=True, text=True)
        if child.returncode != 0:
            print(f"{blas}: failed\n{child.stderr[-2000:]}")
            continue
        for row in json.loads(child.stdout.strip().splitlines()[-1]):
            print(f"{blas:<9} {row['model']:<22} {row['gb']:>8.3f} {row['bandwidth']:>9.1f} "
                  f"{row['ceiling']:>8.1f} {row['products']:>8.1f} {row['products'] / row['ceiling']:>7.0%} "
                  f"{row['mlxcel']:>7.1f} {row['mlxcel'] / row['ceiling']:>7.0%} "
                  f"{row['mlxcel'] / row['products']:>7.0%} "
                  f"{row['mlx_lm']:>7.1f} {row['mlx_lm'] / row['ceiling']:>7.0%} {row['mlx_lm_server']:>10.1f} "
                  f"{row['mlxcel'] / row['mlx_lm']:>7.3f} {row['mlxcel'] / row['mlx_lm_server']:>11.3f}")


if __name__ == "__main__":
    main()
