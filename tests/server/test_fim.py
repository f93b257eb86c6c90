"""Fill-in-the-middle: completions' ``suffix`` (what editors' autocomplete sends) on a model with FIM tokens.

The oracle is transformers' tokenizer of the same checkpoint: the prompt a
Qwen-Coder-style model was trained on, encoded by it, sent as token ids, must
get exactly the completion (text and log-probabilities, at temperature 0) that
``prompt`` and ``suffix`` get.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from mlxcel.server.fim import FORMATS, fim_format, fim_prompt
from tests.server.conftest import running_server

QWEN_FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")
BEFORE, AFTER = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
MIDDLE = ("return a", " + b")
"""The model's answer to a prompt that ends with <|fim_middle|> (its chain starts there)."""


@pytest.fixture(scope="module")
def coder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlxcel.testing.tools import build_scripted_checkpoint

    return build_scripted_checkpoint(tmp_path_factory.mktemp("scripted") / "coder", MIDDLE, markers=QWEN_FIM,
                                     after="<|fim_middle|>")


def test_each_format_lays_out_the_text_around_its_markers() -> None:
    laid = [fim_prompt(form, "<P>", "<S>") for form in FORMATS]
    assert laid[0] == "<|fim_prefix|><P><|fim_suffix|><S><|fim_middle|>"
    assert laid[1] == "<fim_prefix><P><fim_suffix><S><fim_middle>"
    assert laid[2] == "<\uff5cfim\u2581begin\uff5c><P><\uff5cfim\u2581hole\uff5c><S><\uff5cfim\u2581end\uff5c>"
    assert laid[3] == "[SUFFIX]<S>[PREFIX]<P>"  # Codestral: the suffix first
    assert fim_prompt(FORMATS[0], "{suffix}", "x") == "<|fim_prefix|>{suffix}<|fim_suffix|>x<|fim_middle|>"


def test_the_format_is_read_from_the_vocabulary(coder: Path, hello_model: Path) -> None:
    from transformers import AutoTokenizer

    assert fim_format(AutoTokenizer.from_pretrained(coder)) is FORMATS[0]
    assert fim_format(AutoTokenizer.from_pretrained(hello_model)) is None


async def test_suffix_fills_in_the_middle_as_the_models_own_prompt_does(coder: Path, hello_model: Path) -> None:
    from transformers import AutoTokenizer

    expected = AutoTokenizer.from_pretrained(coder)(f"<|fim_prefix|>{BEFORE}<|fim_suffix|>{AFTER}<|fim_middle|>")
    common = {"max_tokens": 8, "temperature": 0, "logprobs": 2}
    async with running_server(["--model", str(coder)]) as url, httpx.AsyncClient(base_url=url) as client:
        filled = (await client.post("/v1/completions", json={"prompt": BEFORE, "suffix": AFTER, **common})).json()
        oracle = (await client.post("/v1/completions", json={"prompt": expected["input_ids"], **common})).json()
        streamed = await client.post("/v1/completions", json={"prompt": BEFORE, "suffix": AFTER, "stream": True,
                                                               **common})
        refused = {name: await client.post("/v1/completions", json={"prompt": prompt, "suffix": AFTER, **extra})
                   for name, prompt, extra in (("echo", BEFORE, {"echo": True}), ("ids", [1, 2, 3], {}))}
        chat = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                               "suffix": AFTER})
    assert filled["usage"]["prompt_tokens"] == len(expected["input_ids"])
    assert filled["choices"][0]["text"] == oracle["choices"][0]["text"] == "".join(MIDDLE)
    assert filled["choices"][0]["logprobs"]["token_logprobs"] == oracle["choices"][0]["logprobs"]["token_logprobs"]
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["text"] for e in events for c in e["choices"]) == filled["choices"][0]["text"]
    assert refused["echo"].status_code == 400 and refused["echo"].json()["error"]["param"] == "echo"
    assert refused["ids"].status_code == 400 and "text prompt" in refused["ids"].json()["error"]["message"]
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "unsupported_parameter"
    async with running_server(["--model", str(hello_model)]) as url, httpx.AsyncClient(base_url=url) as client:
        plain = await client.post("/v1/completions", json={"prompt": BEFORE, "suffix": AFTER})
    assert plain.status_code == 400 and plain.json()["error"]["code"] == "unsupported_parameter"
    assert "fill-in-the-middle" in plain.json()["error"]["message"]
