"""Inkling with its ``mtp.safetensors`` head: B=1 decode with the burst pinned on vs off, side by side.

    python -m benchmarks.inkling_mtp [--hidden 512 --layers 8] [--k 2 3 4] [--blas auto] [--tokens 64]

The pairing is mlxcel/families/inkling/tiny.py's at benchmarks/inkling_decode.py's geometry: the
permutation target (its next token a fixed permutation of the current one, every layer still
computed) with a one-block head built to agree with it on every token (``agreeing``) or a random
one (``random``), each in a copy of the target's directory (``--mtp``). For each BLAS, head and K:
acceptance, tokens per round, and decode tokens/s of a server with the burst pinned off and one
pinned on, requests alternating between them (the server's own timings, pooled over the prompts),
the ratio on / off, and whether the two servers' texts are equal (at temperature 0 they must be
when the exactness probe passed; should it veto a pairing on some machine, the burst is run anyway,
``MLXCEL_MTP_ALLOW_INEXACT=1``, to measure its speed, and the texts may then differ).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import httpx

from benchmarks._common import complete, decode_rate, server
from benchmarks.inkling_decode import inkling_model

PROMPTS = ["def wrap(text, width=70):", "class Template:", "import os\nimport sys\n"]
HEADS = ("agreeing", "random")


def pairings(hidden: int, layers: int) -> dict[str, Path]:
    """Per head kind, a copy of the permutation target's directory with that head's mtp.safetensors."""
    from mlxcel.families.inkling.tiny import build_mtp

    target = inkling_model(hidden, layers, kind="permutation")
    paths = {}
    for kind in HEADS:
        paths[kind] = target.with_name(f"{target.name}-{kind}-mtp")
        if not (paths[kind] / "mtp.safetensors").exists():
            shutil.copytree(target, paths[kind], dirs_exist_ok=True)
            build_mtp(paths[kind], kind=kind)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--k", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--blas", nargs="+", default=["auto"])
    args = parser.parse_args()
    paths = pairings(args.hidden, args.layers)
    size = sum(f.stat().st_size for f in paths["agreeing"].glob("model*.safetensors")) / 1e6
    print(f"target: permutation Inkling, hidden {args.hidden}, {args.layers} layers, {size:.0f} MB fp32; "
          f"heads: 1 block; {args.tokens} tokens, {len(PROMPTS)} prompts")
    print(f"{'BLAS':>5} {'head':>8} {'K':>2} {'accept':>7} {'tok/round':>9} {'off tok/s':>9} {'on tok/s':>9} "
          f"{'ratio':>6}  same text")
    for blas in args.blas:
        for kind in HEADS:
            for k in args.k:
                settings = {"MLXCEL_BLAS": blas, "MLXCEL_DRAFT_BLOCK_SIZE": str(k), "MLXCEL_MTP_ALLOW_INEXACT": "1"}
                with server(paths[kind], "--mtp", env={**settings, "MLXCEL_ENABLE_MTP_B1": "0"}) as off, \
                        server(paths[kind], "--mtp", env={**settings, "MLXCEL_ENABLE_MTP_B1": "1"}) as on, \
                        httpx.Client(timeout=600) as client:
                    complete(client, off, "warm up", 8)
                    complete(client, on, "warm up", 8)
                    off_bodies, on_bodies = [], []
                    for prompt in PROMPTS:
                        off_bodies.append(complete(client, off, prompt, args.tokens))
                        on_bodies.append(complete(client, on, prompt, args.tokens))
                timings = [b["timings"] for b in on_bodies]
                proposed, accepted, rounds = (sum(t[n] for t in timings)
                                              for n in ("draft_n", "draft_n_accepted", "draft_rounds"))
                off_rate, on_rate = decode_rate(off_bodies), decode_rate(on_bodies)
                same = [b["choices"][0]["text"] for b in on_bodies] == [b["choices"][0]["text"] for b in off_bodies]
                print(f"{blas:>5} {kind:>8} {k:>2} {accepted / max(1, proposed):>7.2f} "
                      f"{1 + accepted / max(1, rounds):>9.2f} {off_rate:>9.1f} {on_rate:>9.1f} "
                      f"{on_rate / off_rate:>6.2f}  {'yes' if same else 'no'}")


if __name__ == "__main__":
    main()
