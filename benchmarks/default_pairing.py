"""The bundled default pairing on this machine: acceptance, MTP speedup, and the policy's own verdict.

    python -m benchmarks.default_pairing [--k 2 3 4] [--blas auto off]

On held-out prompts of its domain (functions of standard-library files the
model never trained on): for each BLAS and K, the burst pinned on vs off side
by side (acceptance, tokens per round, decode rates over all the prompts'
tokens, their ratio, and the median ratio of the (off, on) pairs: each
prompt runs on both sides back to back, which keeps this shared machine's
slow spells, seconds long, out of the comparison), then a fresh unpinned
server profiling four requests, and the verdict it settles on.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import httpx

from benchmarks._common import complete, decode_rate, median, server
from mlxcel.families.qwen3_5.train_default import held_out_prompts
from mlxcel.serve_cli import BUNDLED_MODEL


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--k", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--blas", nargs="+", default=["auto", "off"])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args()
    prompts = held_out_prompts(8)
    print(f"model: {BUNDLED_MODEL.name}, {len(prompts)} held-out prompts, {args.tokens} tokens")
    print(f"{'BLAS':<5} {'K':>2} {'accept':>6} {'tok/round':>9} {'off tok/s':>9} {'on tok/s':>9} {'ratio':>6} "
          f"{'pairs':>6} {'verdict (est.)':>16}")
    for blas in args.blas:
        for k in args.k:
            env = {"MLXCEL_BLAS": blas, "MLXCEL_DRAFT_BLOCK_SIZE": str(k)}
            with server(BUNDLED_MODEL, "--mtp", env={**env, "MLXCEL_ENABLE_MTP_B1": "0"}) as off, \
                    server(BUNDLED_MODEL, "--mtp", env={**env, "MLXCEL_ENABLE_MTP_B1": "1"}) as on, \
                    httpx.Client(timeout=600) as client:
                complete(client, off, "warm up", 8)
                complete(client, on, "warm up", 8)
                off_bodies, on_bodies, ratios, proposed, accepted, rounds = [], [], [], 0, 0, 0
                for prompt in prompts * args.passes:
                    off_bodies.append(complete(client, off, prompt, args.tokens))
                    body = complete(client, on, prompt, args.tokens)
                    on_bodies.append(body)
                    if min(body["timings"]["predicted_n"], off_bodies[-1]["timings"]["predicted_n"]) > 1:
                        ratios.append(decode_rate(body) / decode_rate(off_bodies[-1]))
                    proposed += body["timings"]["draft_n"]
                    accepted += body["timings"]["draft_n_accepted"]
                    rounds += body["timings"]["draft_rounds"]
            with tempfile.TemporaryDirectory() as cache, \
                    server(BUNDLED_MODEL, "--mtp", env={**env, "MLXCEL_CACHE_DIR": cache}) as url, \
                    httpx.Client(timeout=600) as client:
                for prompt in prompts[:4]:
                    complete(client, url, prompt, args.tokens)
                for _ in range(50):  # the last sample reaches the policy just after its response
                    policy = client.get(f"{url}/v1/internal/mtp-policy").json()
                    if policy["state"] != "profiling":
                        break
                    time.sleep(0.1)
            verdict = f"{policy['verdict'] or policy['state']} ({policy['estimated_speedup'] or 0:.2f})"
            off_rate, on_rate = decode_rate(off_bodies), decode_rate(on_bodies)
            pairs = median(ratios) if ratios else float("nan")
            print(f"{blas:<5} {k:>2} {accepted / max(1, proposed):>6.2f} {1 + accepted / max(1, rounds):>9.2f} "
                  f"{off_rate:>9.1f} {on_rate:>9.1f} {on_rate / off_rate:>6.2f} {pairs:>6.2f} "
                  f"{verdict:>16}", flush=True)


if __name__ == "__main__":
    main()
