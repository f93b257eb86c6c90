"""A lone request whose burst the rule of K keeps parked: classic steps inside the burst against classic decode.

    python -m benchmarks.lone_parked [--layers 24 --hidden 1024] [--tokens 128] [--rounds 5]

Two servers side by side on one Qwen 3.5 pairing whose in-checkpoint head never
agrees: ``off`` without ``--mtp`` (classic decode), ``parked`` with ``--mtp`` and
an ``enable`` verdict restored from a hint, so every lone request runs the burst
and the rule of K (width 1) decides each round: it looks at K = 1, finds the
drafts rejected, and runs classic steps inside the burst, looking again after
cooldowns that double. What that costs against classic decode: the target
adapter's forward (the hidden states kept), the drafter's catch-up, runs of at
most 8 pipelined steps, the rule's choice each step, its looks. Lone greedy
requests alternate between the servers; prints the median tokens/s of each, the
ratio, and the draft rounds the parked server ran.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from mlxcel.blas import load_fast_blas

print(f"BLAS: {load_fast_blas()}")

import httpx  # noqa: E402

from benchmarks._common import median, mtp_model, server  # noqa: E402
from benchmarks.batch_mtp import PROMPTS  # noqa: E402
from mlxcel.hardware import detect_host, kernel_versions  # noqa: E402
from mlxcel.policy import Hint, HintStore, PairingKey  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model = mtp_model("random", 0.0, args.layers, args.hidden)
    cache = Path(tempfile.mkdtemp(prefix="lone-parked-"))
    key = PairingKey(target=model.name, drafter=f"{model.name}#mtp", hardware=detect_host().label, block_size=4)
    HintStore(cache, kernel_versions()).save(Hint(key=key, verdict="enable", acceptance_rate=0.8, samples=4,
                                                  estimated_speedup=1.5))
    env = {"MLXCEL_DRAFT_BLOCK_SIZE": "4", "MLXCEL_CACHE_DIR": str(cache)}
    print(f"model: {model.name}, {args.tokens} tokens a request, {args.rounds} rounds")
    with ExitStack() as stack:
        urls = {"off": stack.enter_context(server(model, env=env)),
                "parked": stack.enter_context(server(model, "--mtp", env=env))}
        client = stack.enter_context(httpx.Client(timeout=7200))
        rates: dict[str, list[float]] = {side: [] for side in urls}
        rounds = 0
        for index in range(args.rounds + 1):  # the first: compiles and caches, not timed
            for side, url in urls.items():
                body = {"prompt": PROMPTS[index % len(PROMPTS)], "max_tokens": args.tokens, "temperature": 0}
                start = time.perf_counter()
                response = client.post(f"{url}/v1/completions", json=body)
                response.raise_for_status()
                answer = response.json()
                if index:
                    rates[side].append(answer["usage"]["completion_tokens"] / (time.perf_counter() - start))
                    rounds += answer["timings"]["draft_rounds"] if side == "parked" else 0
        policy = client.get(f"{urls['parked']}/v1/internal/mtp-policy").json()
    mid = {side: median(values) for side, values in rates.items()}
    print(f"off {mid['off']:.2f} tokens/s, parked {mid['parked']:.2f} tokens/s: parked / off "
          f"{mid['parked'] / mid['off']:.3f}; the parked server's draft rounds: {rounds} in "
          f"{args.rounds * args.tokens} tokens; its verdict {policy['verdict']}, cells {policy['batch']['cells']}")


if __name__ == "__main__":
    main()
