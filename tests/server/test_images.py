"""Images on every route: each bad image a 400 in the route's own shape that names it and the problem, and a model
that reads text only refusing a good one (after the checks); nothing of an image's content in the log.

The server is the module's shared text-only model (``hello_client``); the checks themselves, with bounds small
enough to reach, are model-free (:func:`mlxcel.server.images.decode_all`).
"""

from __future__ import annotations

import base64
import io
import logging
from typing import Any

import httpx
import pytest
from PIL import Image

from mlxcel.http.errors import ApiError
from mlxcel.server.images import ImageLimits, ImageRef, decode_all


def _encoded(image: Image.Image, kind: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=kind)
    return out.getvalue()


PNG = _encoded(Image.new("RGB", (64, 48), (200, 30, 30)))
PNG_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()


def _url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"


def _chat(url: str, count: int = 1) -> dict[str, Any]:
    parts = [{"type": "text", "text": "What is this?"},
             *({"type": "image_url", "image_url": {"url": url}} for _ in range(count))]
    return {"messages": [{"role": "user", "content": parts}], "max_tokens": 4}


BAD = [  # (the image URL, the error code, a phrase of the message)
    ("https://example.com/cat.png", "image_url_not_fetched", "does not fetch images"),
    ("ftp://example.com/cat.png", "invalid_image", "must be a data: URL"),
    ("data:image/png,rawbytes", "invalid_image", "base64 data: URL"),
    ("data:text/plain;base64,aGVsbG8=", "invalid_image", "'text/plain', not an image"),
    ("data:image/png;base64,not base64!", "invalid_image", "not valid base64"),
    ("data:image/png;base64,", "invalid_image", "is empty"),
    (_url(b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg"/>', "image/svg+xml"), "invalid_image",
     "SVG"),
    (_url(_encoded(Image.new("RGB", (8, 8)), "TIFF"), "image/tiff"), "invalid_image", "supported format"),
    (_url(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4), "invalid_image", "supported format"),
    (_url(PNG[: len(PNG) // 2]), "invalid_image", "truncated or corrupt"),
    (_url(_encoded(Image.new("1", (6000, 6000)))), "image_too_large", "6000 x 6000 pixels"),
]


@pytest.mark.parametrize(("url", "code", "says"), BAD, ids=[case[1] + "-" + case[2][:12] for case in BAD])
def test_each_bad_image_is_a_400_that_names_it(hello_client: httpx.Client, url: str, code: str, says: str) -> None:
    answer = hello_client.post("/v1/chat/completions", json=_chat(url))
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == (code, "messages") and says in error["message"]
    assert error["message"].startswith("messages.0.content: the image")


def test_a_text_only_model_refuses_a_good_image_on_every_route(hello_client: httpx.Client,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    chat = hello_client.post("/v1/chat/completions", json=_chat(PNG_URL)).json()["error"]
    assert chat["code"] == "model_not_supported" and "reads text only" in chat["message"]
    source = {"type": "base64", "media_type": "image/png", "data": PNG_URL.split(",", 1)[1]}
    for content in ([{"type": "text", "text": "What is this?"}, {"type": "image", "source": source}],
                    [{"type": "tool_result", "tool_use_id": "t1",  # an image the agent's Read tool returned
                      "content": [{"type": "text", "text": "screenshot"}, {"type": "image", "source": source}]}]):
        body = {"model": "default", "max_tokens": 4, "messages": [
            {"role": "user", "content": "look"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {}}]},
            {"role": "user", "content": content}]}
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            answer = hello_client.post(path, json=body)
            assert answer.status_code == 400 and answer.json()["type"] == "error", (path, answer.text)
            assert "reads text only" in answer.json()["error"]["message"]
    bad = {"type": "base64", "media_type": "image/png", "data": "AAAA"}
    answer = hello_client.post("/v1/messages", json={"model": "default", "max_tokens": 4, "messages": [
        {"role": "user", "content": [{"type": "image", "source": bad}]}]})
    assert "truncated or corrupt" in answer.json()["error"]["message"] or "supported format" in answer.text
    document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
    answer = hello_client.post("/v1/messages", json={"model": "default", "max_tokens": 4, "messages": [
        {"role": "user", "content": [document]}]})
    assert answer.status_code == 400 and "document blocks" in answer.json()["error"]["message"]
    responses = hello_client.post("/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": PNG_URL}]}]})
    assert responses.status_code == 400 and "reads text only" in responses.json()["error"]["message"]
    assert responses.json()["error"]["param"] == "input"  # the route's own field
    broken = hello_client.post("/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]}).json()["error"]
    assert broken["param"] == "input" and broken["message"].startswith("input.0.content: the image")
    by_file = hello_client.post("/v1/responses", json={"input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "file-1"}]}]})
    assert by_file.status_code == 400 and "file_id is not served" in by_file.json()["error"]["message"]
    too_many = hello_client.post("/v1/chat/completions", json=_chat(PNG_URL, count=17)).json()["error"]
    assert too_many["code"] == "too_many_images" and "at most 16" in too_many["message"]
    assert PNG_URL.split(",", 1)[1][:40] not in caplog.text  # nothing of an image's content is logged
    text = hello_client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 4})
    assert text.status_code == 200  # and it serves on


def test_the_checks_with_bounds_small_enough_to_reach() -> None:
    limits = ImageLimits(max_images=2, max_bytes=len(PNG) - 1, max_pixels=64 * 48)
    with pytest.raises(ApiError, match=f"is {len(PNG)} bytes, more than {len(PNG) - 1}"):
        decode_all([ImageRef("messages.0.content", PNG_URL)], limits)
    roomy = ImageLimits(max_images=2, max_bytes=10_000, max_pixels=64 * 48)
    (image,) = decode_all([ImageRef("messages.0.content", PNG_URL)], roomy)
    assert (image.width, image.height, image.format, image.rgb.mode) == (64, 48, "PNG", "RGB")
    assert image.rgb.getpixel((0, 0)) == (200, 30, 30)
    other = decode_all([ImageRef("m", _url(_encoded(Image.new("RGB", (64, 48), (0, 0, 0)))))], roomy)[0]
    assert other.digest != image.digest  # what caches will key on: the content
    with pytest.raises(ApiError, match="65 x 48 pixels"):
        decode_all([ImageRef("m", _url(_encoded(Image.new("RGB", (65, 48)))))], roomy)
    with pytest.raises(ApiError, match="3 images; at most 2"):
        decode_all([ImageRef("m", PNG_URL)] * 3, roomy)
    jpeg = decode_all([ImageRef("m", _url(_encoded(Image.new("RGB", (8, 8)), "JPEG"), "image/jpeg"))], roomy)[0]
    assert jpeg.format == "JPEG"


@pytest.mark.parametrize("is_error", [False, True])
def test_a_tool_results_texts_around_an_image_read_as_they_would_without_it(is_error: bool) -> None:
    """Claude Code's Read tool: a ``tool_result`` of texts and a screenshot. Its texts are joined as those of a
    result without an image are (a line apart, after ``Error: ``), the image in its place between them."""
    from mlxcel.server.anthropic_schemas import MessagesRequest, to_chat

    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    content = [{"type": "text", "text": "shot.png"}, image, {"type": "text", "text": "1024 x 768"}]
    request = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": is_error,
                                      "content": content}]}]})
    parts = to_chat(request)["messages"][-1]["content"]
    texts = "".join(part["text"] if part["type"] == "text" else "<image>" for part in parts)
    assert texts == ("Error: " if is_error else "") + "shot.png<image>\n1024 x 768"
    without = content[:1] + content[2:]
    request = MessagesRequest.model_validate({"model": "m", "max_tokens": 4, "messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": is_error,
                                      "content": without}]}]})
    assert to_chat(request)["messages"][-1]["content"] == texts.replace("<image>", "")
