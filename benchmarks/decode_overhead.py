"""B=1 classic decode through `mlxcel serve` vs mlx-lm's own `stream_generate`, same model, same run.

    python -m benchmarks.decode_overhead [--rounds 5] [--tokens 256]

Prints both decode rates (tokens/s, median of the rounds, the two sides
interleaved) and the ratio server / mlx-lm. Target: the server loses <= 5%.
"""

from __future__ import annotations

import argparse
import time

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import httpx  # noqa: E402

from benchmarks._common import add_model_arguments, bench_model, median, server, stream_decode_rate  # noqa: E402

PROMPT = "def wrap(text, width=70, **kwargs):"


def mlx_lm_rate(model_path: str, prompt: str, max_tokens: int, loaded: dict[str, object]) -> float:
    from mlx_lm import load, stream_generate

    if not loaded:
        loaded["model"], loaded["tokenizer"] = load(model_path)
    times = []
    for _ in stream_generate(loaded["model"], loaded["tokenizer"], prompt, max_tokens=max_tokens):  # type: ignore[arg-type]
        times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser, rounds=5, tokens=256)
    args = parser.parse_args()
    model = bench_model("llama", args.hidden, args.layers)
    print(f"model: {model.name} (fp32 random weights), {args.tokens} tokens, {args.rounds} rounds")
    ours, theirs = [], []
    loaded: dict[str, object] = {}
    with server(model, "--parallel", "1") as url, httpx.Client(timeout=300) as client:
        stream_decode_rate(client, url, PROMPT, 16)  # warm up both sides
        mlx_lm_rate(str(model), PROMPT, 16, loaded)
        for _ in range(args.rounds):
            ours.append(stream_decode_rate(client, url, PROMPT, args.tokens))
            theirs.append(mlx_lm_rate(str(model), PROMPT, args.tokens, loaded))
    print(f"mlxcel serve (HTTP stream):  {median(ours):8.1f} tok/s  {[round(x, 1) for x in ours]}")
    print(f"mlx-lm stream_generate:      {median(theirs):8.1f} tok/s  {[round(x, 1) for x in theirs]}")
    print(f"ratio server / mlx-lm: {median(ours) / median(theirs):.3f}")


if __name__ == "__main__":
    main()
