"""A Gemma 4 vision checkpoint served with its images, through real HTTP and the ``openai`` and ``anthropic`` SDKs.

The checkpoint is tiny and built with transformers' own classes (:mod:`mlxcel.families.gemma4.tiny_vision`); the
reference is transformers' greedy ``generate`` on the same conversation, its image through transformers' own image
processor. Its vocabulary is bytes, so the expected text is the greedy tokens' bytes.
"""

from __future__ import annotations

import base64
import functools
import io
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from mlxcel.families.gemma4.tiny_vision import build_vision_checkpoint
from tests.server.conftest import anthropic_client, read_tool_screenshot, server_on_a_thread

QUESTION = "What is this?"
TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vision_checkpoint(tmp_path_factory.mktemp("gemma4-images") / "gemma4-vision")


@pytest.fixture(scope="module")
def url(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    env = {"MLXCEL_CACHE_DIR": str(tmp_path_factory.mktemp("gemma4-images-cache"))}
    with server_on_a_thread(["--model", str(checkpoint), "--parallel", "4"], env) as served:
        yield served


def _image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(120, 160, 3), dtype=np.uint8))


def _png(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


@functools.cache
def _reference(checkpoint: Path) -> tuple[Any, Any, Any]:
    """transformers' model, tokenizer and image processor of *checkpoint*, loaded once a module."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Gemma4ImageProcessorPil

    return (AutoModelForImageTextToText.from_pretrained(checkpoint).eval(), AutoTokenizer.from_pretrained(checkpoint),
            Gemma4ImageProcessorPil.from_pretrained(checkpoint))


def _expected(checkpoint: Path, image: Image.Image, question: str = QUESTION,
              after: tuple[dict[str, Any], ...] = ()) -> str:
    """transformers' greedy continuation of a user turn (the image, then *question*) and the turns *after* it, as
    text."""
    import torch

    model, tokenizer, processor = _reference(checkpoint)
    pixels = processor(images=[image], return_tensors="pt")
    count = int(pixels["num_soft_tokens_per_image"][0])
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"},
                                                                       {"type": "text", "text": question}]}, *after],
                                         add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer.encode(text.replace("<|image|>", "<|image>" + "<|image|>" * count + "<image|>"),
                                         add_special_tokens=False)])
    image_token = json.loads((checkpoint / "config.json").read_text())["image_token_id"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, pixel_values=pixels["pixel_values"], do_sample=False,
                             image_position_ids=pixels["image_position_ids"], max_new_tokens=TOKENS,
                             mm_token_type_ids=(ids == image_token).long())
    pieces = tokenizer.convert_ids_to_tokens(out[0, ids.shape[1]:].tolist())
    data = b"".join(bytes([int(p[3:5], 16)]) if p.startswith("<0x") else p.replace("▁", " ").encode()
                    for p in pieces)
    return data.decode("utf-8", errors="replace")


def _chat(image: Image.Image, question: str = QUESTION) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + _png(image)}},
        {"type": "text", "text": question}]}], "max_tokens": TOKENS, "temperature": 0}


def test_an_image_prompt_answers_as_transformers_on_each_api(url: str, checkpoint: Path) -> None:
    expected = _expected(checkpoint, _image(0))
    answer = httpx.post(f"{url}/v1/chat/completions", json=_chat(_image(0)), timeout=60).json()
    assert answer["choices"][0]["message"]["content"] == expected
    assert answer["usage"]["prompt_tokens"] > 60  # the image's soft tokens are counted
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model="default", stream=True, **_chat(_image(0))) if chunk.choices)
    assert streamed == expected
    source = {"type": "base64", "media_type": "image/png", "data": _png(_image(0))}
    with anthropic_client(url) as client:
        message = client.messages.create(model="default", max_tokens=TOKENS, extra_body={"temperature": 0}, messages=[
            {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}]}])
    assert "".join(block.text for block in message.content if block.type == "text") == expected
    responses = httpx.post(f"{url}/v1/responses", timeout=60, json={
        "max_output_tokens": TOKENS, "temperature": 0, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64," + _png(_image(0))},
            {"type": "input_text", "text": QUESTION}]}]}).json()
    assert responses["output"][-1]["content"][0]["text"] == expected


def test_another_image_another_answer_and_no_cache_shared_between_them(url: str, checkpoint: Path) -> None:
    first = httpx.post(f"{url}/v1/chat/completions", json=_chat(_image(1)), timeout=60).json()
    second = httpx.post(f"{url}/v1/chat/completions", json=_chat(_image(2)), timeout=60).json()
    assert first["choices"][0]["message"]["content"] == _expected(checkpoint, _image(1))
    assert second["choices"][0]["message"]["content"] == _expected(checkpoint, _image(2))
    assert first["choices"][0]["message"]["content"] != second["choices"][0]["message"]["content"]
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] < 10  # the text before the image only


def test_image_and_text_requests_at_once_each_get_their_own_answer(url: str, checkpoint: Path) -> None:
    expected = {seed: _expected(checkpoint, _image(seed)) for seed in (3, 4)}
    text_only = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": TOKENS, "temperature": 0}
    alone = httpx.post(f"{url}/v1/chat/completions", json=text_only, timeout=60).json()

    def ask(index: int) -> tuple[int, str]:
        body = text_only if index % 3 == 2 else _chat(_image(3 + index % 3))
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
        return index, answer["choices"][0]["message"]["content"]

    with ThreadPoolExecutor(6) as pool:
        answers = dict(pool.map(ask, range(6)))
    for index, text in answers.items():
        want = alone["choices"][0]["message"]["content"] if index % 3 == 2 else expected[3 + index % 3]
        assert text == want, index


def test_a_screenshot_a_tool_returned_is_seen(url: str) -> None:
    """Claude Code's Read tool returns an image inside a ``tool_result``: the model sees it (another image,
    another answer), through the ``anthropic`` SDK."""
    answers = []
    with anthropic_client(url) as client:
        for seed in (5, 6):
            source = {"type": "base64", "media_type": "image/png", "data": _png(_image(seed))}
            message = read_tool_screenshot(client, source, TOKENS)
            answers.append("".join(block.text for block in message.content if block.type == "text"))
            assert message.usage.input_tokens > 60
    assert answers[0] != answers[1]


def test_the_next_turn_resending_the_screenshot_resumes_after_it(url: str, checkpoint: Path) -> None:
    """An agent resends its screenshot each turn: the next turn's prompt is found in the prefix cache past the
    image (keyed by the image's hash), and its answer is still transformers'."""
    first = httpx.post(f"{url}/v1/chat/completions", json=_chat(_image(7)), timeout=60).json()
    said = first["choices"][0]["message"]["content"]
    after = ({"role": "assistant", "content": said}, {"role": "user", "content": "And now?"})
    body = _chat(_image(7))
    body["messages"] += list(after)
    second = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 1
    assert second["choices"][0]["message"]["content"] == _expected(checkpoint, _image(7), after=after)
    other = _chat(_image(8))
    other["messages"] += list(after)
    changed = httpx.post(f"{url}/v1/chat/completions", json=other, timeout=60).json()
    assert changed["usage"]["prompt_tokens_details"]["cached_tokens"] < 10  # the text before the image only


def test_the_mtp_burst_after_an_image_gives_classic_decodes_text(url: str, checkpoint: Path, tmp_path: Path) -> None:
    """With Gemma 4's assistant as drafter, an image prompt's temperature-0 text is classic decode's (the module's
    server, which has no drafter), the burst having run (its rounds counted): drafting resumes after the image
    prefill as after a cache hit. (Compared with classic decode, not transformers: past a dozen tokens this random
    model writes ``<|audio|>``, which transformers' forward takes for an audio placeholder and blanks.)"""
    from mlxcel.families.gemma4.tiny import build_assistant

    assistant = build_assistant(tmp_path / "assistant", checkpoint)
    body = _chat(_image(0))
    body["max_tokens"] = 24
    with server_on_a_thread(["--model", str(checkpoint), "--draft-model", str(assistant)],
                            {"MLXCEL_CACHE_DIR": str(tmp_path / "cache")}) as served:
        answer = httpx.post(f"{served}/v1/chat/completions", json=body, timeout=120).json()
    classic = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    assert answer["timings"]["draft_rounds"] > 0 and not classic["timings"].get("draft_rounds")
    assert answer["choices"][0]["message"]["content"] == classic["choices"][0]["message"]["content"]
    assert classic["choices"][0]["message"]["content"].startswith(_expected(checkpoint, _image(0)))
