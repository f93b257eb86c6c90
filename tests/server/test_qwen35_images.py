"""A Qwen 3.5 vision checkpoint (the gated-delta hybrid) served with its images and its MTP head, through real
HTTP and the ``openai`` and ``anthropic`` SDKs.

The checkpoint is tiny and built with transformers' own classes (:mod:`mlxcel.families.qwen3_5.tiny_vision`); the
reference is transformers' greedy ``generate`` on the same conversation, its images through transformers' own
image processor and multi-axis positions. The module's server runs with ``--mtp``: every answer below is MTP's,
and equal to transformers' greedy text is equal to classic decode's.
"""

from __future__ import annotations

import base64
import functools
import io
import json
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from mlxcel.families.qwen3_5.tiny_vision import build_vision_checkpoint
from tests.server.conftest import anthropic_client, read_tool_screenshot, server_on_a_thread

QUESTION = "What is this?"
TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_vision_checkpoint(tmp_path_factory.mktemp("qwen35-images") / "qwen35-vision", mtp=True)


@pytest.fixture(scope="module")
def url(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # MTP pinned on: the burst and the batch speculate whatever the measured costs say of this tiny model.
    env = {"MLXCEL_CACHE_DIR": str(tmp_path_factory.mktemp("qwen35-images-cache")), "MLXCEL_ENABLE_MTP_B1": "1"}
    # Prefill chunks of 16 tokens: an image's 30 tokens always straddle one. The origin's web server: loopback.
    flags = ["--mtp", "--parallel", "4", "--prefill-step-size", "16", "--allow-image-urls",
             "--allow-private-image-urls"]
    with server_on_a_thread(["--model", str(checkpoint), *flags], env) as served:
        yield served


def _image(seed: int, width: int = 200, height: int = 150) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8))


def _data_url(image: Image.Image) -> str:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@functools.cache
def _reference(checkpoint: Path) -> tuple[Any, Any, Any]:
    """transformers' model, tokenizer and image processor of *checkpoint*, loaded once a module."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessorPil

    return (AutoModelForImageTextToText.from_pretrained(checkpoint).eval(), AutoTokenizer.from_pretrained(checkpoint),
            Qwen2VLImageProcessorPil.from_pretrained(checkpoint))


_EXPECTED: dict[tuple[Path, str, tuple[tuple[tuple[int, int], bytes], ...]], str] = {}


def _expected(checkpoint: Path, messages: list[dict[str, Any]], images: list[Image.Image]) -> str:
    """transformers' greedy continuation of *messages* (``{"type": "image"}`` parts take *images* in order); the
    same conversation's once a module."""
    key = (checkpoint, json.dumps(messages, sort_keys=True), tuple((image.size, image.tobytes()) for image in images))
    if key not in _EXPECTED:
        _EXPECTED[key] = _greedy(checkpoint, messages, images)
    return _EXPECTED[key]


def _greedy(checkpoint: Path, messages: list[dict[str, Any]], images: list[Image.Image]) -> str:
    import torch

    model, tokenizer, processor = _reference(checkpoint)
    pixels = processor(images=images, return_tensors="pt")
    pieces = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False).split("<|image_pad|>")
    counts = [int(g.prod()) // 4 for g in pixels["image_grid_thw"]]
    text = pieces[0] + "".join("<|image_pad|>" * count + piece for count, piece in zip(counts, pieces[1:], strict=True))
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    with torch.no_grad():
        out = model.generate(input_ids=ids, pixel_values=pixels["pixel_values"], max_new_tokens=TOKENS,
                             image_grid_thw=pixels["image_grid_thw"], do_sample=False,
                             mm_token_type_ids=(ids == model.config.image_token_id).int())
    said = out[0, ids.shape[1]:].tolist()
    while said and said[-1] == model.config.text_config.eos_token_id:  # the stop token is not text
        said.pop()
    return str(tokenizer.decode(said))


def _asked(question: str = QUESTION) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


def _chat(*images: Image.Image, question: str = QUESTION) -> dict[str, Any]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": _data_url(image)}} for image in images]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}],
            "max_tokens": TOKENS, "temperature": 0}


def _said(answer: dict[str, Any]) -> str:
    return str(answer["choices"][0]["message"]["content"])


def test_an_image_prompt_answers_as_transformers_on_each_api_with_mtp(url: str, checkpoint: Path) -> None:
    expected = _expected(checkpoint, _asked(), [_image(0)])
    answer = httpx.post(f"{url}/v1/chat/completions", json=_chat(_image(0)), timeout=60).json()
    assert _said(answer) == expected
    assert answer["timings"]["draft_rounds"] > 0  # the MTP burst ran after the image prefill
    assert answer["usage"]["prompt_tokens"] > 30  # the image's 30 tokens are counted
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
            model="default", stream=True, **_chat(_image(0))) if chunk.choices)
    assert streamed == expected
    source = {"type": "base64", "media_type": "image/png", "data": _data_url(_image(0)).split(",")[1]}
    with anthropic_client(url) as client:
        message = client.messages.create(model="default", max_tokens=TOKENS, extra_body={"temperature": 0}, messages=[
            {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}]}])
    assert "".join(block.text for block in message.content if block.type == "text") == expected
    responses = httpx.post(f"{url}/v1/responses", timeout=60, json={
        "max_output_tokens": TOKENS, "temperature": 0, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": _data_url(_image(0))}, {"type": "input_text", "text": QUESTION}]}]})
    assert responses.json()["output"][-1]["content"][0]["text"] == expected


def test_two_images_of_other_sizes_in_one_prompt(url: str, checkpoint: Path) -> None:
    pictures = [_image(1, 64, 130), _image(2, 180, 60)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"},
                                             {"type": "text", "text": QUESTION}]}]
    answer = httpx.post(f"{url}/v1/chat/completions", json=_chat(*pictures), timeout=60).json()
    assert _said(answer) == _expected(checkpoint, messages, pictures)


def test_image_and_text_requests_at_once_in_the_batch(url: str, checkpoint: Path) -> None:
    """The hybrid model batches image prompts with text ones, the batch speculating, each its own answer."""
    expected = {seed: _expected(checkpoint, _asked(), [_image(seed)]) for seed in (3, 4)}
    text_only = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": TOKENS, "temperature": 0}
    alone = _said(httpx.post(f"{url}/v1/chat/completions", json=text_only, timeout=60).json())

    def ask(index: int) -> tuple[int, dict[str, Any]]:
        body = text_only if index % 3 == 2 else _chat(_image(3 + index % 3))
        return index, httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()

    with ThreadPoolExecutor(6) as pool:
        answers = dict(pool.map(ask, range(6)))
    assert {index: _said(answer) for index, answer in answers.items()} == {
        index: alone if index % 3 == 2 else expected[3 + index % 3] for index in range(6)}
    widths = [n for answer in answers.values() for n in answer["timings"]["draft_widths"]]
    assert any(n >= 2 for n in widths)  # drafted beside others (which widths: arrival timing)


def test_the_next_turns_resume_after_a_resent_image_and_not_across_a_new_one(url: str, checkpoint: Path) -> None:
    """The next agent turn resends its screenshot: found in the prefix cache past the image. A turn that adds a
    second image moves every position of the first (module docstring of :mod:`mlxcel.families.qwen3_5.vision`):
    prefilled anew, and still transformers' answer."""
    first = httpx.post(f"{url}/v1/chat/completions", json=_chat(_image(7)), timeout=60).json()
    after = [{"role": "assistant", "content": _said(first)}, {"role": "user", "content": "And now?"}]
    body = _chat(_image(7))
    body["messages"] += after
    second = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] - 1
    assert _said(second) == _expected(checkpoint, [*_asked(), *after], [_image(7)])

    more = _chat(_image(7))
    more["messages"] += [after[0], {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _data_url(_image(8, 96, 96))}},
        {"type": "text", "text": "And this?"}]}]
    third = httpx.post(f"{url}/v1/chat/completions", json=more, timeout=60).json()
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert _said(third) == _expected(checkpoint, [*_asked(), after[0], {"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "And this?"}]}], [_image(7), _image(8, 96, 96)])


def test_another_screenshot_after_the_same_long_prompt_resumes_where_the_images_begin(url: str,
                                                                                       checkpoint: Path) -> None:
    """An agent's next request: the same system prompt, another screenshot (of the same size: the same positions).
    The hybrid model's cache cannot be rewound, so the image prefill kept a snapshot where the images begin."""
    system = {"role": "system", "content": "You are a coding agent. Read the screenshot and answer. " * 12}

    def ask(seed: int) -> dict[str, Any]:
        body = _chat(_image(seed))
        body["messages"].insert(0, system)
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()

    first, second = ask(12), ask(13)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 300 < cached < first["usage"]["prompt_tokens"] - 30  # the system prompt, not the image
    assert _said(second) == _expected(checkpoint, [system, *_asked()], [_image(13)])


def test_a_screenshot_a_tool_returned_is_seen(url: str, checkpoint: Path) -> None:
    """Claude Code's Read tool returns an image inside a ``tool_result``, through the ``anthropic`` SDK: the answer
    is transformers' for the conversation with that image in the tool's result (another image, another answer)."""
    rendered = [{"role": "user", "content": "Look at the screenshot."},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
                    "name": "Read", "arguments": {"file_path": "shot.png"}}}]},
                {"role": "tool", "content": [{"type": "image"}]}]
    answers = []
    with anthropic_client(url) as client:
        for seed in (5, 7):
            source = {"type": "base64", "media_type": "image/png", "data": _data_url(_image(seed)).split(",")[1]}
            message = read_tool_screenshot(client, source, TOKENS)
            answers.append("".join(block.text for block in message.content if block.type == "text"))
            assert answers[-1] == _expected(checkpoint, rendered, [_image(seed)])
            assert message.usage.input_tokens > 30
    assert answers[0] != answers[1]


def test_a_sliver_the_processor_cannot_take_is_a_400(url: str) -> None:
    answer = httpx.post(f"{url}/v1/chat/completions", json=_chat(_image(9, 1000, 4)), timeout=60)
    assert answer.status_code == 400 and "aspect ratio" in answer.json()["error"]["message"]


@pytest.fixture(scope="module")
def origin() -> Iterator[str]:
    """A web server on this machine's loopback holding ``/shot.png`` (the standard library's, on a thread)."""
    body = base64.b64decode(_data_url(_image(0)).split(",")[1])

    class Shot(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/shot.png" else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Shot)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_image_by_url_is_fetched_where_allowed(url: str, checkpoint: Path, origin: str) -> None:
    """``--allow-image-urls``: chat's ``image_url`` and Anthropic's ``url`` source fetch the image (this server
    also allows loopback, where the test's web server is); the answer is the inline image's."""
    expected = _expected(checkpoint, _asked(), [_image(0)])
    body = _chat(_image(0))
    body["messages"][0]["content"][0]["image_url"]["url"] = f"{origin}/shot.png"
    assert _said(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()) == expected
    with anthropic_client(url) as client:
        message = client.messages.create(model="default", max_tokens=TOKENS, extra_body={"temperature": 0}, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": f"{origin}/shot.png"}},
                                         {"type": "text", "text": QUESTION}]}])
    assert "".join(block.text for block in message.content if block.type == "text") == expected
    body["messages"][0]["content"][0]["image_url"]["url"] = f"{origin}/gone.png"
    missing = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert missing.status_code == 400 and missing.json()["error"]["code"] == "image_fetch_failed"


def test_a_restarted_server_resumes_after_the_image_from_its_disk_tier(checkpoint: Path, tmp_path: Path) -> None:
    """The hybrid model's snapshot after an image prompt goes to the disk tier when the server stops, keyed by the
    image (and its positions' shift); the next server reads it back for the same image, and not for another."""
    env = {"MLXCEL_CACHE_DIR": str(tmp_path / "cache")}
    with server_on_a_thread(["--model", str(checkpoint)], env) as served:
        first = httpx.post(f"{served}/v1/chat/completions", json=_chat(_image(10)), timeout=60).json()
    with server_on_a_thread(["--model", str(checkpoint)], env) as served:
        again = httpx.post(f"{served}/v1/chat/completions", json=_chat(_image(10)), timeout=60).json()
        other = httpx.post(f"{served}/v1/chat/completions", json=_chat(_image(11)), timeout=60).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == first["usage"]["prompt_tokens"] - 1
    assert _said(again) == _said(first) == _expected(checkpoint, _asked(), [_image(10)])
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] < 10  # before its image, not past it


def test_a_grammar_holds_with_an_image_in_the_prompt(url: str) -> None:
    """``response_format`` constrains the answer about an image as about text (MTP on, the grammar's row drafts
    nothing), and the answer parses."""
    body = _chat(_image(14))
    body.update(max_tokens=64, response_format={"type": "json_schema", "json_schema": {"name": "seen", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}}})
    answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(_said(answer))["n"], int)


def test_qwen36_moe_answers_an_image_as_transformers(tmp_path: Path) -> None:
    """Qwen 3.6's mixture-of-experts vision checkpoint, served: transformers' greedy text. (Its MTP head is
    vetoed by the exactness probe on this BLAS, the MoE verify not being byte-exact here: served without.)"""
    moe = build_vision_checkpoint(tmp_path / "qwen36-moe-vision", moe=True)
    with server_on_a_thread(["--model", str(moe)], {"MLXCEL_CACHE_DIR": str(tmp_path / "cache")}) as served:
        answer = httpx.post(f"{served}/v1/chat/completions", json=_chat(_image(15)), timeout=60).json()
    assert _said(answer) == _expected(moe, _asked(), [_image(15)])
