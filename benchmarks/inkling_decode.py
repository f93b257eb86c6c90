"""Classic decode of mlxcel's own Inkling model file against a same-size llama in mlx-lm.

Both are random fp32 checkpoints of the same width, depth and MLP width (Inkling's MLPs all dense,
so the extra cost shown is its own: the relative-position bias, the four short convolutions per
layer, the q/k norms). Each side decodes ``--tokens`` greedy tokens after a short prompt, in one
process, alternating rounds; the ratio is Inkling's tokens/s over llama's.

    python -m benchmarks.inkling_decode [--rounds 5 --tokens 64 --hidden 512 --layers 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks._common import BENCH_DIR, add_model_arguments, bench_model


def geometry(hidden: int, layers: int) -> dict[str, Any]:
    """A benchmark Inkling's text config: the tests' layout at the width of the llama *bench_model*
    builds (its heads; dense MLPs as wide as its MLP, no MoE), window 512, relative extent 1024."""
    heads, kv_heads = hidden // 64, max(1, hidden // 256)
    return dict(hidden=hidden, layers=layers, dense_mlp_idx=layers, intermediate_size=3 * hidden,
                num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64, swa_num_attention_heads=heads,
                swa_num_key_value_heads=kv_heads, swa_head_dim=64, sliding_window_size=512, rel_extent=1024)


def inkling_model(hidden: int, layers: int, kind: str = "random") -> Path:
    """A random (or ``permutation``) fp32 Inkling target of :func:`geometry` whose config declares one
    MTP block (the weights are not there: mlxcel/families/inkling/tiny.py's ``build_mtp`` writes them),
    built once under .bench."""
    from mlxcel.families.inkling.tiny import build_target

    directory = BENCH_DIR / f"inkling{'' if kind == 'random' else '-' + kind}-h{hidden}-l{layers}"
    if not (directory / "model.safetensors").exists():
        build_target(directory, kind=kind, mtp_layers=1, **geometry(hidden, layers))
    return directory


def decode_rate(model: Any, tokens: int) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    logits = model(mx.array([[5, 6, 7, 8]]), cache=cache)
    mx.eval(logits)
    started = time.perf_counter()
    for _ in range(tokens):
        logits = model(mx.argmax(logits[:, -1:], axis=-1), cache=cache)
        mx.eval(logits)
    return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser, rounds=5, tokens=64)
    args = parser.parse_args()
    from mlxcel.checkpoints import inspect_checkpoint, load_checkpoint

    models = {"inkling": load_checkpoint(inspect_checkpoint(inkling_model(args.hidden, args.layers)))[0],
              "llama": load_checkpoint(inspect_checkpoint(bench_model("llama", args.hidden, args.layers)))[0]}
    rates: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.rounds):
        for name, model in models.items():
            rates[name].append(decode_rate(model, args.tokens))
    median = {name: statistics.median(r) for name, r in rates.items()}
    for name, rate in median.items():
        print(f"{name}: {rate:.1f} tokens/s (median of {args.rounds})")
    print(f"inkling / llama: {median['inkling'] / median['llama']:.2f}")


if __name__ == "__main__":
    main()
