"""Long contexts: prefill and decode at depth, mlxcel against mlx-lm on the same model and BLAS.

    python -m benchmarks.long_context [--families llama qwen3_5] [--hidden 1024] [--layers 12]
        [--depths 0 2048 8192] [--tokens 32] [--chunks 512 2048] [--mlx-lm-server] [--repeats 1]

For each model (fp32, random weights, a context window to match the deepest
prompt) and each depth: a prompt of that many tokens (0: a short line), then
--tokens greedy tokens. Side by side in one run, each in a fresh process:

- mlxcel: ``mlxcel serve --prefill-step-size C --prompt-cache-size 0``, one
  completion; prefill tokens/s from ``timings.prompt_ms``, decode tokens/s
  from ``timings.predicted_ms``; peak resident memory (the server's VmHWM).
- mlx-lm: ``stream_generate(..., prefill_step_size=C)`` in a child process
  with the same BLAS loaded first; its ``prompt_tps`` and ``generation_tps``,
  and the child's peak resident memory.
- with ``--mlx-lm-server``: ``mlx_lm.server``, streamed; prefill tokens/s as
  prompt tokens / time to the first token, decode as the stream's rate.

Prints one row per (family, depth, chunk) and the ratios mlxcel / mlx-lm. With
``--repeats N`` each cell runs N pairs, the two sides alternating; the row then
holds each figure's median, the ratios are the pairs' median ratios, and the
pairs' prefill ratios follow the row.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import httpx  # noqa: E402

from benchmarks._common import context_model, context_window, median, mlx_lm_server, peak_mb, server, words  # noqa: E402

#: What the mlx-lm side runs in its own process: the same BLAS first, then one warm-up and one measured run.
_MLX_LM = """
import json, resource, sys
from mlxcel.blas import load_fast_blas
load_fast_blas()
from mlx_lm import load, stream_generate
path, chunk, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ids = json.loads(sys.stdin.read())
model, tokenizer = load(path)
for _ in stream_generate(model, tokenizer, ids[:8], max_tokens=4):
    pass
for last in stream_generate(model, tokenizer, ids, max_tokens=tokens, prefill_step_size=chunk):
    pass
print(json.dumps({"prompt_tps": last.prompt_tps, "generation_tps": last.generation_tps,
                  "generated": last.generation_tokens, "prompt": last.prompt_tokens,
                  "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def prompt_ids(checkpoint: Path, depth: int) -> list[int]:
    """*depth* tokens of words (at least a short line's), as the model's tokenizer reads them."""
    import random

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids: list[int] = tokenizer.encode(words(tokenizer, max(depth, 8), random.Random(depth)), add_special_tokens=False)
    return ids[:max(depth, 8)]


def ours(checkpoint: Path, ids: list[int], tokens: int, chunk: int) -> dict[str, float]:
    with server(checkpoint, "--prefill-step-size", str(chunk), "--prompt-cache-size", "0", "--props") as url, \
            httpx.Client(timeout=7200) as client:
        client.post(f"{url}/v1/completions", json={"prompt": ids[:8], "max_tokens": 4, "temperature": 0})
        body = client.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": tokens,
                                                           "temperature": 0}).json()
        timings = body["timings"]
        return {"prefill": timings["prompt_n"] / timings["prompt_ms"] * 1000,
                "decode": timings["predicted_n"] / timings["predicted_ms"] * 1000, "generated": timings["predicted_n"],
                "peak_mb": peak_mb(url)}


def theirs(checkpoint: Path, ids: list[int], tokens: int, chunk: int) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", _MLX_LM, str(checkpoint), str(chunk), str(tokens)],
                          input=json.dumps(ids), capture_output=True, text=True, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["prompt"] == len(ids), out
    return {"prefill": out["prompt_tps"], "decode": out["generation_tps"], "generated": out["generated"],
            "peak_mb": out["peak_mb"]}


def their_server(checkpoint: Path, ids: list[int], tokens: int) -> dict[str, float]:
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(checkpoint).decode(ids)
    with mlx_lm_server(checkpoint) as url, httpx.Client(timeout=7200) as client:
        client.post(f"{url}/v1/completions", json={"prompt": "warm up", "max_tokens": 4, "temperature": 0})
        start = time.perf_counter()
        times = []
        with client.stream("POST", f"{url}/v1/completions", json={
                "prompt": text, "max_tokens": tokens, "temperature": 0, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    times.append(time.perf_counter())
        first, last = times[0] - start, times[-1] - times[0]
        return {"prefill": len(ids) / first, "decode": (len(times) - 1) / last if last > 0 else float("nan"),
                "generated": len(times), "peak_mb": float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--families", nargs="+", default=["llama", "qwen3_5"])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--depths", type=int, nargs="+", default=[0, 2048, 8192])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--chunks", type=int, nargs="+", default=[512])
    parser.add_argument("--mlx-lm-server", action="store_true")
    parser.add_argument("--repeats", type=int, default=1, help="pairs of runs per cell, the sides alternating")
    args = parser.parse_args()
    context = context_window(max(args.depths) + args.tokens)
    print("family   depth chunk | prefill tok/s: mlxcel  mlx-lm  ratio | decode tok/s: mlxcel  mlx-lm  ratio "
          "| peak MB: mlxcel mlx-lm" + (" | mlx_lm.server prefill decode" if args.mlx_lm_server else ""))
    for family in args.families:
        checkpoint = context_model(family, args.hidden, args.layers, context)
        weights = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors")) / 1e6
        print(f"{family}: {weights:.0f} MB of weights, context window {context}", flush=True)
        for depth in args.depths:
            ids = prompt_ids(checkpoint, depth)
            for chunk in args.chunks:
                pairs = [(ours(checkpoint, ids, args.tokens, chunk), theirs(checkpoint, ids, args.tokens, chunk))
                         for _ in range(args.repeats)]
                a, b = ({key: median([run[key] for run in runs]) for key in runs[0]}
                        for runs in zip(*pairs, strict=True))
                prefill = [x["prefill"] / y["prefill"] for x, y in pairs]
                decode = median([x["decode"] / y["decode"] for x, y in pairs])
                row: Any = (f"{family:8s} {len(ids):5d} {chunk:5d} | {a['prefill']:14.1f} {b['prefill']:7.1f} "
                            f"{median(prefill):6.2f} | {a['decode']:13.1f} {b['decode']:7.1f} "
                            f"{decode:6.2f} | {a['peak_mb']:8.0f} {b['peak_mb']:6.0f}")
                if args.mlx_lm_server and chunk == args.chunks[0]:
                    c = their_server(checkpoint, ids, args.tokens)
                    row += f" | {c['prefill']:8.1f} {c['decode']:6.1f}"
                if args.repeats > 1:
                    row += "  (prefill ratios: " + " ".join(f"{r:.2f}" for r in prefill) + ")"
                print(row, flush=True)


if __name__ == "__main__":
    main()
