"""Decode of one model sharded over two processes (``--distributed``) vs the same model in one process.

    python -m benchmarks.distributed_decode [--mode pipeline|tensor] [--rounds 5] [--tokens 64]
                                           [--hidden 64] [--layers 4]

Both servers run at once on loopback: a plain ``mlxcel serve`` and two ranks
of ``mlxcel serve --distributed MODE`` under ``mlx.launch -n 2 --backend
ring``. Each round sends the same greedy completion to each, alternating; the
rate is the server's own decode rate (``timings``). Pipeline: a Qwen 3.5 target
(mlx-lm pipelines it; llama it does not), tensor: a llama. The default size is
the tests' tiny model; ``--hidden 512 --layers 8`` is the benchmarks' usual one.
Prints medians and the ratio sharded / single.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import httpx

from benchmarks._common import BENCH_DIR, complete, decode_rate, median, server

PROMPT = "def wrap(text, width=70, **kwargs):"


def model_for(mode: str, hidden: int, layers: int) -> Path:
    from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
    from mlxcel.testing.checkpoints import build_checkpoint, write_weight_index

    if mode == "pipeline":
        directory = BENCH_DIR / f"qwen35-h{hidden}-l{layers}-indexed"
        if not (directory / "model.safetensors.index.json").exists():
            write_weight_index(build_mtp_checkpoint(directory, layers=layers, hidden=hidden))
        return directory
    directory = BENCH_DIR / f"llama-h{hidden}-l{layers}-tensor"
    if not (directory / "model.safetensors").exists():
        heads = max(2, hidden // 32)
        build_checkpoint(directory, "llama", scale=2.0, hidden_size=hidden, num_hidden_layers=layers,
                         intermediate_size=hidden * 2, num_attention_heads=heads, num_key_value_heads=2,
                         head_dim=hidden // heads)
    return directory


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["pipeline", "tensor"], default="pipeline")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    model = model_for(args.mode, args.hidden, args.layers)
    print(f"model: {model.name} (fp32 random weights), {args.tokens} tokens, {args.rounds} rounds, {args.mode}")
    from mlxcel.testing.serving import launched

    rates: dict[str, list[float]] = {"single": [], "sharded": []}
    with server(model, "--prompt-cache-size", "0") as single, \
            launched(model, args.mode, BENCH_DIR / f"launch-{time.time_ns()}.log") as (sharded, _), \
            httpx.Client(timeout=600) as client:
        urls = {"single": single, "sharded": sharded}
        texts = {name: complete(client, url, PROMPT, args.tokens)["choices"][0]["text"]
                 for name, url in urls.items()}  # warm up, and the same text on both
        if texts["single"] != texts["sharded"]:
            print("warning: the sharded text differs from the single-process text")
        for _ in range(args.rounds):
            for name, url in urls.items():
                rates[name].append(decode_rate(complete(client, url, PROMPT, args.tokens)))
    for name, values in rates.items():
        print(f"{name:8s} decode tok/s: median {median(values):7.1f}  ({', '.join(f'{v:.1f}' for v in values)})")
    print(f"ratio sharded / single: {median(rates['sharded']) / median(rates['single']):.3f}")


if __name__ == "__main__":
    main()
