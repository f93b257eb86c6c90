"""The grammar's masks for a verify's positions, and its rollback, against a fresh llguidance matcher.

The oracle is llguidance itself, driven the plain way: a new ``LLMatcher`` that
consumes the same tokens one by one and computes its bitmask.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import llguidance
import numpy as np
import pytest

from mlxcel.engine.grammar import GrammarProcessor, grammar_tokenizer
from mlxcel.server.structured import JSON_OPTIONS
from mlxcel.testing.base import VOCAB_SIZE, write_tokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
          "additionalProperties": False}
GRAMMAR = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=JSON_OPTIONS)  # type: ignore[arg-type]
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, int]:
    from mlx_lm.tokenizer_utils import load

    directory: Path = tmp_path_factory.mktemp("grammar")
    write_tokenizer(directory)
    hf = load(directory)  # mlx-lm's wrapper, as the server loads it
    eos = int(hf.convert_tokens_to_ids("<|im_end|>"))
    return hf, grammar_tokenizer(hf, VOCAB_SIZE, frozenset([eos])), eos


def _oracle_mask(llg: Any, tokens: list[int]) -> np.ndarray:
    matcher = llguidance.LLMatcher(llg, GRAMMAR, log_level=0)
    assert matcher.consume_tokens(tokens)
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
    return bits[:VOCAB_SIZE].astype(np.bool_)


def test_masks_follow_the_drafts_up_to_the_first_forbidden_one_and_roll_back(
        tokenizers: tuple[Any, Any, int]) -> None:
    hf, llg, _ = tokenizers
    document: list[int] = hf.encode('{"a": 12}')
    forbidden = hf.encode("x")
    assert len(forbidden) == 1 and len(document) >= 4
    grammar = GrammarProcessor(llguidance.LLMatcher(llg, GRAMMAR, log_level=0), len(PROMPT))
    # The round's input is the last prompt token; three drafts of the document, then one JSON forbids there.
    drafts = [*document[:3], forbidden[0], document[3]]
    masks, consumed = grammar.draft_masks(PROMPT, drafts, VOCAB_SIZE)
    assert consumed == 3 and len(masks) == 4
    for position, mask in enumerate(masks):
        assert np.array_equal(mask, _oracle_mask(llg, document[:position]))
    assert not masks[3][forbidden[0]]
    # The round kept one draft: the matcher is where a classic decode of that one token leaves it.
    grammar.rollback(consumed - 1)
    assert grammar.consumed == 1
    masks, consumed = grammar.draft_masks([*PROMPT, document[0], document[1]], document[2:3], VOCAB_SIZE)
    assert consumed == 1
    assert np.array_equal(masks[0], _oracle_mask(llg, document[:2]))
    assert np.array_equal(masks[1], _oracle_mask(llg, document[:3]))


def test_masks_stop_where_the_grammar_ends(tokenizers: tuple[Any, Any, int]) -> None:
    hf, llg, eos = tokenizers
    document: list[int] = hf.encode('{"a": 1}')
    grammar = GrammarProcessor(llguidance.LLMatcher(llg, GRAMMAR, log_level=0), len(PROMPT))
    # The closing brace completes the grammar: the next position allows only the end of sequence, and
    # from there on the matcher, stopped, masks and consumes nothing, as in classic decode.
    masks, consumed = grammar.draft_masks([*PROMPT, *document[:-1]], [document[-1], eos, document[0]], VOCAB_SIZE)
    assert consumed == 1 and len(masks) == 2
    assert np.array_equal(masks[0], _oracle_mask(llg, document[:-1]))
    assert np.array_equal(masks[1], _oracle_mask(llg, document))
    assert np.flatnonzero(masks[1]).tolist() == [eos] and grammar.matcher.is_stopped()
    grammar.rollback(1)  # a round that kept no draft: the brace is the next round's input
    assert not grammar.matcher.is_stopped() and grammar.consumed == len(document) - 1
    masks, consumed = grammar.draft_masks([*PROMPT, *document], [eos], VOCAB_SIZE)
    assert consumed == 0 and np.array_equal(masks[0], _oracle_mask(llg, document))
