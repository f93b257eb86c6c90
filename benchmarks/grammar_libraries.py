"""llguidance, xgrammar and outlines-core side by side: compile time and the per-token mask cost.

Each library gets the same byte-level BPE tokenizer (trained here on the Python
standard library, ``--vocab`` entries: the serving models' tokenizers are
not on this machine) and the same JSON schema, then walks the same valid JSON
document token by token: compute the mask of allowed tokens, consume the
next token. Printed: the time to prepare the tokenizer, to compile the schema,
and the median per-token mask + consume time, with each one's ratio to
llguidance's. A library that is not installed is skipped::

    python -m benchmarks.grammar_libraries
    PYTHONPATH=/tmp/xg:/tmp/oc python -m benchmarks.grammar_libraries   # scratch installs of the other two
"""

from __future__ import annotations

import argparse
import json
import statistics
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._common import BENCH_DIR

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0},
    "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                "required": ["street", "city"], "additionalProperties": False}},
    "required": ["name", "age", "email", "tags", "address"], "additionalProperties": False}
DOCUMENT = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
                       "tags": ["math", "engines", "poetry", "notes"],
                       "address": {"street": "12 St James's Square", "city": "London"}}, separators=(",", ":"))
"""Compact, in the schema's property order: what every library's grammar spells here."""


def tokenizer(vocab: int) -> Any:
    """A Hugging Face fast tokenizer of *vocab* byte-level BPE entries (built once, kept in .bench)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = BENCH_DIR / f"bpe-{vocab}.json"
    if not path.exists():
        BENCH_DIR.mkdir(exist_ok=True)
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in sorted(stdlib.glob("*.py"))]
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        bpe.train_from_iterator(texts, trainer=trainer)
        bpe.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|endoftext|>")


Walk = Callable[[list[int]], list[float]]


def _timed_walk(mask: Callable[[], Any], consume: Callable[[int], Any], tokens: list[int]) -> list[float]:
    times = []
    for token in tokens:
        started = time.perf_counter()
        mask()
        consume(token)
        times.append(time.perf_counter() - started)
    return times


def llguidance_side(hf: Any, vocab: int) -> tuple[float, float, Walk]:
    import llguidance
    import llguidance.hf

    started = time.perf_counter()
    tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    prepared = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                            defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(tok, grammar)
    assert not matcher.is_error(), matcher.get_error()
    compiled = time.perf_counter()
    return prepared - started, compiled - prepared, lambda t: _timed_walk(matcher.compute_bitmask,
                                                                          matcher.consume_token, t)


def xgrammar_side(hf: Any, vocab: int) -> tuple[float, float, Walk]:
    import xgrammar

    started = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    prepared = time.perf_counter()
    compiled_grammar = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                   separators=(",", ":"))
    matcher = xgrammar.GrammarMatcher(compiled_grammar)
    compiled = time.perf_counter()
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    return prepared - started, compiled - prepared, lambda t: _timed_walk(
        lambda: matcher.fill_next_token_bitmask(bitmask), matcher.accept_token, t)


def outlines_side(hf: Any, vocab: int) -> tuple[float, float, Walk]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    started = time.perf_counter()
    decoder = {v: k for k, v in _byte_encoder().items()}
    entries: dict[bytes, list[int]] = {}
    eos = hf.eos_token_id
    for piece, token in hf.get_vocab().items():
        if token != eos:
            entries.setdefault(bytes(decoder[c] for c in piece), []).append(token)
    vocabulary = Vocabulary(eos, entries)
    prepared = time.perf_counter()
    index = Index(build_regex_from_schema(json.dumps(SCHEMA), whitespace_pattern=""), vocabulary)
    guide = Guide(index)
    compiled = time.perf_counter()
    mask = np.zeros((vocab + 31) // 32, dtype=np.int32)
    return prepared - started, compiled - prepared, lambda t: _timed_walk(
        lambda: guide.write_mask_into(mask.ctypes.data, mask.size, 4), guide.advance, t)


def _byte_encoder() -> dict[int, str]:
    """GPT-2's byte-to-character table (what byte-level BPE vocabularies are spelled in)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


SIDES = {"llguidance": llguidance_side, "xgrammar": xgrammar_side, "outlines-core": outlines_side}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    hf = tokenizer(args.vocab)
    vocab = len(hf)
    tokens = hf.encode(DOCUMENT, add_special_tokens=False)
    print(f"vocabulary {vocab}, document {len(tokens)} tokens")
    results: dict[str, tuple[float, float, float]] = {}
    for name, side in SIDES.items():
        try:
            prepare, compile_s, walk = side(hf, vocab)
        except ImportError as exc:
            print(f"{name}: not installed ({exc})")
            continue
        per_token = [statistics.median(walk(tokens)) for _ in range(1)]
        for _ in range(args.rounds - 1):  # a fresh matcher per round: the walk consumes it
            per_token.append(statistics.median(side(hf, vocab)[2](tokens)))
        results[name] = (prepare, compile_s, statistics.median(per_token))
    base = results.get("llguidance")
    for name, (prepare, compile_s, per_token) in results.items():
        ratio = f"  ({per_token / base[2]:.2f}x llguidance's per-token time)" if base else ""
        print(f"{name:14s} tokenizer {prepare * 1000:8.1f} ms  compile {compile_s * 1000:8.2f} ms  "
              f"mask+consume {per_token * 1e6:8.1f} us/token{ratio}")


if __name__ == "__main__":
    main()
