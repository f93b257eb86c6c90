"""The same B=1 decode with `MLXCEL_BLAS=off` (mlx's reference BLAS) and `auto` (system OpenBLAS).

    python -m benchmarks.blas [--tokens 128]

Two servers, one per setting, run in turn; prints both decode rates and the ratio auto / off.
"""

from __future__ import annotations

import argparse

import httpx

from benchmarks._common import add_model_arguments, bench_model, median, server, stream_decode_rate

PROMPT = "def wrap(text, width=70, **kwargs):"


def main() -> None:
    parser = argparse.ArgumentParser()
    add_model_arguments(parser, rounds=3, tokens=128)
    args = parser.parse_args()
    model = bench_model("llama", args.hidden, args.layers)
    print(f"model: {model.name}, {args.tokens} tokens, {args.rounds} rounds")
    rates: dict[str, list[float]] = {"off": [], "auto": []}
    for _ in range(args.rounds):
        for setting in rates:
            with server(model, "--parallel", "1", env={"MLXCEL_BLAS": setting}) as url, \
                    httpx.Client(timeout=600) as client:
                blas = client.get(f"{url}/health").json()["observability"]["blas"]
                stream_decode_rate(client, url, PROMPT, 8)
                rates[setting].append(stream_decode_rate(client, url, PROMPT, args.tokens))
                print(f"  MLXCEL_BLAS={setting}: {blas}: {rates[setting][-1]:.1f} tok/s")
    print(f"MLXCEL_BLAS=off:  {median(rates['off']):8.1f} tok/s")
    print(f"MLXCEL_BLAS=auto: {median(rates['auto']):8.1f} tok/s")
    print(f"ratio auto / off: {median(rates['auto']) / median(rates['off']):.2f}")


if __name__ == "__main__":
    main()
