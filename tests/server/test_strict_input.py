"""The edge's bounds (docs/http-api.md): what is refused with a 4xx, and what is brought into range and served."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from mlxcel.engine import Finish
from mlxcel.server.wire import finish_error
from mlxcel.testing.base import VOCAB_SIZE
from tests.server.conftest import open_stream, running_server

PROMPT = "def wrap(text, width=70):"


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


REFUSED = [
    # (raw JSON body, status, code, param)
    (json.dumps({"prompt": PROMPT, "seed": 2**63}), 400, "invalid_request", "seed"),
    (json.dumps({"prompt": PROMPT, "seed": -(2**63) - 1}), 400, "invalid_request", "seed"),
    (json.dumps({"prompt": PROMPT, "stop": ["s"] * 33}), 400, "invalid_request", "stop"),
    (json.dumps({"prompt": PROMPT, "stop": "s" * 1001}), 400, "invalid_request", "stop"),
    (json.dumps({"prompt": PROMPT, "stop": ["ok", "s" * 1001]}), 400, "invalid_request", "stop"),
    (json.dumps({"prompt": PROMPT, "stream_options": {"include_usage": True}}), 400, "invalid_request",
     "stream_options"),
    (json.dumps({"prompt": [1, VOCAB_SIZE]}), 400, "invalid_request", "prompt"),
    (json.dumps({"prompt": [-1]}), 400, "invalid_request", "prompt"),
    (json.dumps({"prompt": [1] * 5000}), 400, "context_length_exceeded", "prompt"),
    (json.dumps({"prompt": PROMPT, "top_logprobs": 2}), 400, "unsupported_parameter", "top_logprobs"),
    (json.dumps({"prompt": PROMPT, "suffix": "x"}), 400, "unsupported_parameter", "suffix"),
    (json.dumps({"prompt": PROMPT, "n": True}), 400, "invalid_request", "n"),
    # Depth: at the C parser's own limit, and below it but beyond the edge's 64 levels.
    ('{"prompt": ' + _nested(1000) + "}", 400, "invalid_json", None),
    ('{"prompt": "x", "extra": ' + _nested(100_000) + "}", 400, "invalid_json", None),
    ('{"prompt": "x", "extra": ' + _nested(65) + "}", 400, "invalid_json", None),
    ('{"prompt": "x", "extra": {"a": ' * 40 + "1" + "}" * 80, 400, "invalid_json", None),
    # A lone surrogate is valid JSON and no text, in the prompt, a message, a stop string or a key.
    ('{"prompt": "\\ud800"}', 400, "invalid_json", None),
    ('{"prompt": "ok \\udfff then"}', 400, "invalid_json", None),
    ('{"prompt": "x", "stop": ["\\ud800"]}', 400, "invalid_json", None),
    ('{"prompt": "x", "\\ud800": 1}', 400, "invalid_json", None),
    # Not JSON numbers, and an integer Python will not parse.
    ('{"prompt": "x", "temperature": NaN}', 400, "invalid_json", None),
    ('{"prompt": "x", "top_p": Infinity}', 400, "invalid_json", None),
    ('{"prompt": "x", "seed": ' + "9" * 5000 + "}", 400, "invalid_json", None),
]


async def test_out_of_range_and_malformed_input_is_a_clean_400(llama: Path) -> None:
    async with running_server(["--model", str(llama)]) as url, httpx.AsyncClient(timeout=60) as client:
        for body, status, code, param in REFUSED:
            response = await client.post(f"{url}/v1/completions", content=body.encode(),
                                         headers={"Content-Type": "application/json"})
            assert response.status_code == status, (body[:80], response.text[:300])
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, param), \
                (body[:80], error)
        chat = await client.post(f"{url}/v1/chat/completions", content=b'{"messages": [{"role": "user", '
                                 b'"content": "\\ud800"}]}', headers={"Content-Type": "application/json"})
        assert chat.status_code == 400 and chat.json()["error"]["code"] == "invalid_json"
        assert (await client.get(f"{url}/health")).status_code == 200


async def test_a_body_that_is_not_utf8_json_is_refused_and_its_size_limit_comes_first(llama: Path) -> None:
    body = json.dumps({"prompt": PROMPT, "max_tokens": 2})
    async with running_server(["--model", str(llama), "--max-body-bytes", "100000"]) as url, \
            httpx.AsyncClient(timeout=60) as client:
        for content_type in ("application/x-www-form-urlencoded", "text/plain", "multipart/form-data; boundary=x"):
            response = await client.post(f"{url}/v1/completions", content=body, headers={"Content-Type": content_type})
            assert response.status_code == 415, (content_type, response.text)
            assert response.json()["error"]["code"] == "unsupported_media_type"
            huge = await client.post(f"{url}/v1/completions", content=b"x" * 200_000,
                                     headers={"Content-Type": content_type})
            assert huge.status_code == 413  # the size limit first, whatever the type
        for content_type in ("application/json; charset=utf-8", "application/vnd.api+json"):
            served = await client.post(f"{url}/v1/completions", content=body, headers={"Content-Type": content_type})
            assert served.status_code == 200, (content_type, served.text)
        served = await client.post(f"{url}/v1/completions", content=body)  # no Content-Type: taken as JSON
        assert served.status_code == 200
        for encoding in ("utf-16", "utf-16-le", "utf-32"):
            response = await client.post(f"{url}/v1/completions", content=body.encode(encoding),
                                         headers={"Content-Type": "application/json"})
            assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json", encoding
            # With a byte-order mark (what Python's parser detects) it says why; without one, NULs are not JSON.
            assert "not UTF-8" in response.json()["error"]["message"] or encoding == "utf-16-le"
        deep = "[" * 1000 + "]" * 1000
        for arguments in (deep, '{"a": ' + "[" * 70 + "]" * 70 + "}"):
            chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"}], "max_tokens": 2}
            response = await client.post(f"{url}/v1/chat/completions", json=chat)
            assert response.status_code == 400, response.text[:300]
            assert "function.arguments" in response.json()["error"]["message"]
        assert (await client.get(f"{url}/health")).status_code == 200


async def test_a_large_body_is_parsed_and_validated_off_the_event_loop_with_the_same_answers(llama: Path) -> None:
    """Above 64 KiB the parse and the validation run in a worker thread: the answers are the small bodies'."""
    extra = [[i, str(i)] for i in range(40_000)]  # ~500 KB
    async with running_server(["--model", str(llama)]) as url, httpx.AsyncClient(timeout=60) as client:
        served = await client.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "extra": extra})
        assert served.status_code == 200
        wrong = await client.post(f"{url}/v1/completions", json={"prompt": PROMPT, "n": "2", "extra": extra})
        assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "n"
        broken = await client.post(f"{url}/v1/completions", content=json.dumps({"extra": extra})[:-1],
                                   headers={"Content-Type": "application/json"})
        assert broken.status_code == 400 and broken.json()["error"]["code"] == "invalid_json"


async def test_values_the_engine_cannot_take_are_brought_into_range(llama: Path) -> None:
    """top_k beyond the vocabulary, negative seeds, tiny temperatures: served, with the documented meaning."""
    async with running_server(["--model", str(llama)]) as url, httpx.AsyncClient(timeout=60) as client:
        async def text(**body: object) -> str:
            response = await client.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 12,
                                                                          **body})
            assert response.status_code == 200, (body, response.text)
            return str(response.json()["choices"][0]["text"])

        greedy = await text(temperature=0)
        # Below 1e-5 a temperature decodes greedily (1/temperature would overflow).
        assert await text(temperature=1e-300) == greedy
        assert await text(temperature=5e-324) == greedy
        # top_k at or above the vocabulary keeps every token: the same as no top-k, seed for seed.
        for top_k in (VOCAB_SIZE, 100_000, 2**70):
            assert await text(temperature=1.0, top_k=top_k, seed=3) == await text(temperature=1.0, seed=3)
        assert await text(temperature=1.0, top_k=VOCAB_SIZE - 1, seed=3)  # the largest real top-k
        # Seeds over OpenAI's whole int64 range work, and a negative one is as reproducible as any.
        for seed in (-1, -(2**63), 2**63 - 1):
            assert await text(temperature=1.0, seed=seed) == await text(temperature=1.0, seed=seed)
        # Harmless values of unsupported parameters, and bounds at their limit.
        assert await text(temperature=0, top_logprobs=0, suffix="", presence_penalty=0.0, logit_bias={},
                          modalities=["text"], audio=None, best_of=1)
        assert await text(temperature=0, stop=["\u00a7" * 1000] * 32) == greedy
        for path, prompt in (("/v1/completions", {"prompt": PROMPT}),
                             ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]})):
            streamed = await client.post(f"{url}{path}", json={
                **prompt, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}})
            assert streamed.status_code == 200 and streamed.text.endswith("data: [DONE]\n\n")
            chunks = [json.loads(line[6:]) for line in streamed.text.split("\n") if line.startswith("data: {")]
            # As OpenAI's schemas: a chat chunk's "usage" is null but on the last, which carries it and no
            # choices; a completion chunk's is not nullable, so it is absent there.
            before = [c.get("usage", "absent") for c in chunks[:-1]]
            assert before == [None if "chat" in path else "absent"] * len(before) and len(chunks) > 1
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 3
        assert (await client.get(f"{url}/health")).status_code == 200


async def test_an_over_long_prompt_is_refused_by_its_length_before_tokenizing(llama: Path) -> None:
    async with running_server(["--model", str(llama)]) as url, httpx.AsyncClient(timeout=60) as client:
        # Longer than context x longest token: cannot fit, whatever the tokenizer makes of it.
        huge = await client.post(f"{url}/v1/completions", json={"prompt": "a" * 3_000_000})
        error = huge.json()["error"]
        assert huge.status_code == 400 and error["code"] == "context_length_exceeded"
        assert "at least" in error["message"]
        chat = await client.post(f"{url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "b" * 3_000_000}]})
        assert chat.status_code == 400 and "at least" in chat.json()["error"]["message"]
        # Within the length bound but over the context: counted exactly, then refused.
        counted = await client.post(f"{url}/v1/completions", json={"prompt": "word " * 5000})
        assert counted.status_code == 400 and "at least" not in counted.json()["error"]["message"]


async def test_capacity_is_checked_before_the_prompt_is_tokenized(llama: Path) -> None:
    async with running_server(["--model", str(llama), "--parallel", "1", "--max-queue-depth", "0"]) as url, \
            httpx.AsyncClient(timeout=60) as client:
        held = await open_stream(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3000,
                                                         "temperature": 0, "stream": True})
        # Over-long, so tokenizing it would have answered 400: 503 shows nothing was tokenized.
        refused = await client.post(f"{url}/v1/completions", json={"prompt": "word " * 5000})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full"
        await held.aclose()


@pytest.mark.parametrize(("finish", "stopping", "status", "kind", "done"), [
    (Finish("error", 3, 0, error="bad grammar", error_type="invalid_request_error"), False, 400,
     "invalid_request_error", True),
    (Finish("error", 3, 1, error="out of memory"), False, 500, "server_error", True),
    (Finish("error", 0, 0, error="server shutting down"), True, 503, "server_error", False),
    (Finish("cancelled", 3, 1, error="the client went away"), False, 503, "server_error", False),
    (None, False, 503, "server_error", False),
])
def test_a_finish_error_maps_to_whose_fault_it_is(finish: Finish | None, stopping: bool, status: int, kind: str,
                                                  done: bool) -> None:
    error, ends_with_done = finish_error(finish, stopping=stopping)
    assert (error.status, error.type, ends_with_done) == (status, kind, done)
    body = error.body()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"]
    if finish is not None and finish.error:
        assert body["message"] == finish.error
