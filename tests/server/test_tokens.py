"""The HTTP layer's tokenizer gate: one call at a time, and a length bound that is a true lower bound."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxcel.server.tokens import Tokens, chars_per_token


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from mlxcel.testing.base import write_tokenizer

    directory = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer(directory)
    return load_tokenizer(directory)


async def test_tokenizer_calls_never_overlap() -> None:
    tokens = Tokens()
    inside, most = 0, 0
    lock = threading.Lock()

    def call() -> None:
        nonlocal inside, most
        with lock:
            inside += 1
            most = max(most, inside)
        time.sleep(0.005)  # long enough for another thread to enter, if the gate let it
        with lock:
            inside -= 1

    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(tokens.run, call)
    assert most == 1


async def test_a_long_text_does_not_hold_up_short_ones(tokenizer: Any) -> None:
    tokens = Tokens()
    long_text = "def wrap(text, width=70): " * 40_000  # about a second to encode
    done: list[str] = []

    async def encode(name: str, text: str) -> None:
        ids = await tokens.encode(tokenizer, text)
        assert ids == tokenizer.encode(text)  # the long lane's own copy encodes the same
        done.append(name)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(encode, "long", long_text)
        await trio.testing.wait_all_tasks_blocked()  # the long one is in its thread
        nursery.start_soon(encode, "short", "def f(x):")
    assert done == ["short", "long"]


def test_the_test_tokenizer_has_a_bound(tokenizer: Any) -> None:
    per_token = chars_per_token(tokenizer)
    assert per_token is not None
    longest = max(len(t) for t in tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
    assert per_token == longest


@settings(max_examples=300, deadline=None)
@given(text=st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=300)
       | st.text("ab \n\t()=:_xyz€😀", min_size=1, max_size=3000))
def test_the_length_bound_never_exceeds_the_real_count(tokenizer: Any, text: str) -> None:
    assert len(tokenizer.encode(text)) >= math.ceil(len(text) / _cached_bound(tokenizer))


_BOUNDS: dict[int, int] = {}


def _cached_bound(tokenizer: Any) -> int:
    if id(tokenizer) not in _BOUNDS:
        bound = chars_per_token(tokenizer)
        assert bound is not None
        _BOUNDS[id(tokenizer)] = bound
    return _BOUNDS[id(tokenizer)]


def test_tokenizers_that_may_drop_text_have_no_bound(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    def wrapped(backend: Tokenizer) -> Any:
        return PreTrainedTokenizerFast(tokenizer_object=backend)

    word_level = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    assert chars_per_token(wrapped(word_level)) is None  # one id for a whole word
    stripping = Tokenizer(models.BPE({"a": 0, "b": 1}, []))
    stripping.normalizer = normalizers.Strip()
    assert chars_per_token(wrapped(stripping)) is None
    whitespace = Tokenizer(models.BPE({"a": 0, "b": 1}, []))
    whitespace.pre_tokenizer = pre_tokenizers.Whitespace()  # drops the spaces
    assert chars_per_token(wrapped(whitespace)) is None
    nfc = Tokenizer(models.BPE({"a": 0, "ab": 1, "b": 2}, [("a", "b")]))
    nfc.normalizer = normalizers.NFC()
    assert chars_per_token(wrapped(nfc)) == 2 * 4  # NFC may merge four code points into one
    assert chars_per_token(object()) is None
