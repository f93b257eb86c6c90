"""mlxcel serves every checkpoint with the tokenizer its own files declare.

The oracle is the `tokenizers` library reading the checkpoint's
``tokenizer.json`` directly, and jinja2 rendering ``tokenizer_config.json``'s
chat template: neither goes through transformers' class selection, which for
some ``model_type`` values (qwen3_5 among them) rebuilds a different
tokenizer from the file's vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jinja2
import pytest
from tokenizers import Tokenizer

from mlxcel.checkpoints import inspect_checkpoint, load_checkpoint
from mlxcel.serve_cli import BUNDLED_MODEL
from mlxcel.testing.checkpoints import FAMILIES, build_checkpoint
from tests.server.conftest import running_server

TEXTS = [
    "x = 12345 + 67 - 890",          # digit runs: split by the GPT-2 regex, not one digit a token
    " leading space and  double  spaces",
    "tabs\tand\nnewlines\n\n    indented",
    "héllo ünïcode — 日本語 🙂",
    "def f(x):\n    return x ** 2  # 3.14159\n",
    "<|im_start|>user\nhi<|im_end|>\n",  # special tokens inside text
]


@pytest.fixture(scope="module")
def directories(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizer-checkpoints")
    return {"bundled": BUNDLED_MODEL,
            **{family: build_checkpoint(root / family, family) for family in FAMILIES}}


@pytest.fixture(scope="module")
def loaded(directories: dict[str, Path]) -> dict[str, Any]:
    return {name: load_checkpoint(inspect_checkpoint(d))[1] for name, d in directories.items()}


@pytest.mark.parametrize("name", ["bundled", *FAMILIES])
def test_ids_are_the_checkpoints_tokenizer_json(name: str, directories: dict[str, Path],
                                                  loaded: dict[str, Any]) -> None:
    reference = Tokenizer.from_file(str(directories[name] / "tokenizer.json"))
    for text in TEXTS:
        assert loaded[name].encode(text) == reference.encode(text).ids, text


@pytest.mark.parametrize("name", ["bundled", *FAMILIES])
def test_streamed_text_is_the_tokenizer_json_decode(name: str, directories: dict[str, Path],
                                                      loaded: dict[str, Any]) -> None:
    # The first token's leading space is kept: a completion's first token is generated text.
    reference = Tokenizer.from_file(str(directories[name] / "tokenizer.json"))
    for text in TEXTS[:-1]:
        ids = reference.encode(" " + text).ids
        detokenizer = loaded[name].detokenizer
        pieces = []
        for token in ids:
            detokenizer.add_token(token)
            pieces.append(detokenizer.last_segment)
        detokenizer.finalize()
        pieces.append(detokenizer.last_segment)
        assert "".join(pieces) == reference.decode(ids) == " " + text


@pytest.mark.parametrize("name", ["bundled", *FAMILIES])
def test_eos_and_chat_template_are_the_configs(name: str, directories: dict[str, Path],
                                                 loaded: dict[str, Any]) -> None:
    config = json.loads((directories[name] / "tokenizer_config.json").read_text())
    reference = Tokenizer.from_file(str(directories[name] / "tokenizer.json"))
    assert loaded[name].eos_token_ids == {reference.token_to_id(config["eos_token"])}
    messages = [{"role": "user", "content": "add 12 and 345"}, {"role": "assistant", "content": " 357"},
                {"role": "user", "content": "thanks"}]
    rendered = jinja2.Template(config["chat_template"]).render(messages=messages, add_generation_prompt=True)
    ids = loaded[name].apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert list(ids) == reference.encode(rendered).ids


async def test_served_prompt_tokens_are_the_tokenizer_json_counts() -> None:
    reference = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    config = json.loads((BUNDLED_MODEL / "tokenizer_config.json").read_text())
    messages = [{"role": "user", "content": "def add(a, b): return a + 12345"},
                {"role": "assistant", "content": " ok"}]
    rendered = jinja2.Template(config["chat_template"]).render(messages=messages, add_generation_prompt=True)
    async with running_server([]) as url, httpx.AsyncClient(timeout=60) as client:
        usages = [(await client.post(f"{url}/v1/completions", json={
            "prompt": text, "max_tokens": 1, "temperature": 0})).json()["usage"] for text in TEXTS]
        chat = (await client.post(f"{url}/v1/chat/completions", json={
            "messages": messages, "max_tokens": 1, "temperature": 0})).json()["usage"]
    assert [u["prompt_tokens"] for u in usages] == [len(reference.encode(t).ids) for t in TEXTS]
    assert chat["prompt_tokens"] == len(reference.encode(rendered).ids)
