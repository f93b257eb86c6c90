"""llguidance's mask per token for a ``pattern`` that repeats a literal N times, against N = 1.

``python -m benchmarks.grammar_mask``: for each count, the median time of ``compute_bitmask`` over 40
tokens of a string ``"aaa...`` under ``^a{N}$`` (and, for comparison, ``maxLength: N``, which llguidance
bounds without unrolling), on the bundled default model's tokenizer. The mask is computed on the batch's
critical path once per token per constrained sequence, so its time is what a co-batched stream waits too;
``mlxcel.server.schema_bounds.MAX_PATTERN_COST`` is chosen from this table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from transformers import AutoTokenizer

from mlxcel.families.qwen3_5 import BUNDLED_MODEL


def _mask_ms(tokenizer: Any, table: Any, schema: dict[str, Any], tokens: int) -> float:
    import llguidance

    matcher = llguidance.LLMatcher(table, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)))
    quote, letter = tokenizer.convert_tokens_to_ids('"'), tokenizer.encode("a", add_special_tokens=False)[0]
    times = []
    for i in range(tokens):
        started = time.perf_counter()
        matcher.compute_bitmask()
        times.append(time.perf_counter() - started)
        matcher.consume_tokens([quote if i == 0 else letter])
    assert not matcher.is_error(), matcher.get_error()
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--counts", type=int, nargs="+", default=[40, 100, 1000, 4096, 16384, 65535])
    parser.add_argument("--tokens", type=int, default=40)
    args = parser.parse_args()
    if min(args.counts) < args.tokens:
        parser.error("every count must be at least --tokens (the string is that long)")
    import llguidance.hf

    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    table = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))
    base = _mask_ms(tokenizer, table, {"type": "string", "pattern": "^a{1,}$"}, args.tokens)
    print(f"vocabulary {len(tokenizer)}; ^a{{1,}}$: {base:.3f} ms per mask")
    print("| N | ^a{N}$ ms | ratio to ^a{1,}$ | maxLength N ms |")
    print("|---|---|---|---|")
    for n in args.counts:
        pattern = _mask_ms(tokenizer, table, {"type": "string", "pattern": f"^a{{{n}}}$"},
                           args.tokens)
        length = _mask_ms(tokenizer, table, {"type": "string", "maxLength": n}, args.tokens)
        print(f"| {n} | {pattern:.3f} | {pattern / base:.1f} | {length:.3f} |")


if __name__ == "__main__":
    main()
