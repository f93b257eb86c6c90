"""A 4-bit (or 8-bit) target vs its float32 original, the same head, MTP on and off, side by side.

    python -m benchmarks.quantized_target [--bits 4] [--context 0.05] [--k 3] [--tokens 96]

The synthetic Qwen 3.5 pairing's target is converted with mlx-lm's own
``convert`` (which drops the head, as community conversions do), the head is
split out of the raw checkpoint with ``mlxcel split-mtp``, and four servers run
at once: each target with the burst pinned off and pinned on. Requests
alternate across the four. Prints, per target: classic tok/s, MTP tok/s, the
on/off ratio and the acceptance, then the quantized/fp32 classic ratio.
"""

from __future__ import annotations

import argparse
from contextlib import ExitStack

import httpx

from benchmarks._common import BENCH_DIR, complete, decode_rate, median, mtp_model, server

PROMPTS = ["def wrap(text, width=70):", "class Template:", "import os\nimport sys\n", "for line in lines:",
           "def dedent(text):", "if __name__ == '__main__':"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bits", type=int, default=4, choices=[4, 8])
    parser.add_argument("--context", type=float, default=0.05, help="the pairing's context dependence")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    raw = mtp_model("aligned", args.context)
    quantized = BENCH_DIR / f"{raw.name}-{args.bits}bit"
    head = BENCH_DIR / f"{raw.name}-MTP"
    if not (quantized / "config.json").exists():
        from mlx_lm import convert

        convert(str(raw), mlx_path=str(quantized), quantize=True, q_bits=args.bits, q_group_size=64)
    if not (head / "config.json").exists():
        from mlxcel.checkpoints import split_mtp

        split_mtp(raw, head, block_size=args.k, report=lambda _: None)
    env = {"MLXCEL_DRAFT_BLOCK_SIZE": str(args.k)}
    targets = {"fp32": raw, f"{args.bits}-bit": quantized}
    with ExitStack() as stack, httpx.Client(timeout=600) as client:
        urls = {(name, pin): stack.enter_context(server(path, "--draft-model", str(head),
                                                        env={**env, "MLXCEL_ENABLE_MTP_B1": pin}))
                for name, path in targets.items() for pin in ("0", "1")}
        for url in urls.values():
            complete(client, url, "warm up", 8)
        bodies: dict[tuple[str, str], list[dict[str, object]]] = {key: [] for key in urls}
        for prompt in PROMPTS:
            for key, url in urls.items():
                bodies[key].append(complete(client, url, prompt, args.tokens))
    print(f"pairing: {raw.name} + split head, K={args.k}, {args.tokens} tokens x {len(PROMPTS)} prompts")
    print(f"{'target':<8} {'classic tok/s':>13} {'MTP tok/s':>9} {'on/off':>6} {'acceptance':>10}")
    classic = {}
    for name in targets:
        off, on = bodies[(name, "0")], bodies[(name, "1")]
        classic[name] = median([decode_rate(b) for b in off])  # type: ignore[arg-type]
        burst = median([decode_rate(b) for b in on])  # type: ignore[arg-type]
        proposed = sum(b["timings"]["draft_n"] for b in on)  # type: ignore[index]
        accepted = sum(b["timings"]["draft_n_accepted"] for b in on)  # type: ignore[index]
        print(f"{name:<8} {classic[name]:>13.1f} {burst:>9.1f} {burst / classic[name]:>6.2f} "
              f"{accepted / proposed if proposed else 0:>10.2f}")
    print(f"classic decode, {args.bits}-bit / fp32: {classic[f'{args.bits}-bit'] / classic['fp32']:.2f}")


if __name__ == "__main__":
    main()
