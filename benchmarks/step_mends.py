"""What a batch's decode step pays for a row's bytes being its own: the two mends, each on and off, in turn.

    python -m benchmarks.step_mends [--rows 1 8] [--depth 350] [--layers 24 --hidden 1024 | --model PATH]
        [--repeats 6]

One fp32 Qwen 3.5 of the MTP benchmarks (``benchmarks/_common.mtp_model``), or the checkpoint at PATH
(``--model bundled``: the default pairing ``mlxcel serve`` serves), in process, on its MLX thread
(:func:`mlxcel.models.attention.mlx_thread`), its products measured for steps of up to ROWS + 1 rows
(:func:`mlxcel.models.row_exact.measure_steps`, as the server does at load). ROWS rows are prefilled to DEPTH keys,
then one-position steps are timed (three a sample, the KV caches stepped back after each so the depth holds)
with: neither mend (mlx's attention, whole products), the products padded or chunked as measured, the lone
query's attention grouped in blocks, both (what mlxcel serves). Interleaved, medians in milliseconds, and
each over neither.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from mlxcel.blas import load_fast_blas

print(load_fast_blas())

from benchmarks._common import mtp_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--depth", type=int, default=350)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--model", help="a checkpoint's directory, or 'bundled' (the default pairing)")
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel.models import attention
    from mlxcel.models.row_exact import measure_steps

    if args.model == "bundled":
        from mlxcel.families.qwen3_5 import BUNDLED_MODEL

        args.model = BUNDLED_MODEL
    model, _ = load(str(args.model or mtp_model("aligned", 0.0, layers=args.layers, hidden=args.hidden)))
    print(f"{'rows':>4} {'neither ms':>10} {'products':>8} {'grouped':>8} {'both':>8}   (ratios to neither)")
    with attention.mlx_thread():
        split = measure_steps(model, max(args.rows) + 1)
        products = (split.chunks, split.pads) if split is not None else ({}, {})
        rules = attention._thread.rules
        for rows in args.rows:
            cache = make_prompt_cache(model)
            for start in range(0, args.depth, 128):
                model(mx.random.randint(0, 1000, (rows, min(128, args.depth - start))), cache=cache)
                mx.eval([c.state for c in cache])
            token = mx.random.randint(0, 1000, (rows, 1))
            sides = {"neither": (({}, {}), False), "products": (products, False), "grouped": (({}, {}), True),
                     "both": (products, True)}
            times: dict[str, list[float]] = {name: [] for name in sides}
            for _ in range(args.repeats):
                for name, ((chunks, pads), grouped) in sides.items():
                    if split is not None:
                        split.chunks, split.pads = chunks, pads
                    rules.grouped = grouped
                    _step(model, token, cache)
                    started = time.perf_counter()
                    for _ in range(3):
                        _step(model, token, cache)
                    times[name].append((time.perf_counter() - started) / 3 * 1e3)
            if split is not None:
                split.chunks, split.pads = products
            rules.grouped = mx.default_device() == mx.cpu
            ms = {name: statistics.median(values) for name, values in times.items()}
            print(f"{rows:>4} {ms['neither']:>10.1f} " + " ".join(
                f"{ms[name]:>5.1f} ({ms[name] / ms['neither']:.2f})" for name in ("products", "grouped", "both")))


def _step(model: Any, token: Any, cache: list[Any]) -> None:
    """One step of every row, then its KV caches stepped back (the recurrent layers' state moves on: a step
    costs the same whatever it holds)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    mx.eval(model(token, cache=cache))
    for layer in cache:
        if isinstance(layer, KVCache):
            layer.offset -= 1


if __name__ == "__main__":
    main()
