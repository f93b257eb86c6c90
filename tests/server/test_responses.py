"""OpenAI's Responses API through the official ``openai`` SDK (``client.responses``), against a real server.

As the Messages API tests: models scripted to answer every chat with a fixed
reply, so every assertion is exact; prompt sizes checked against transformers'
own rendering of the same conversation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import trio

from tests.server.conftest import HELLO, TINY_PNG, running_server
from tests.server.test_anthropic import _rendered_length

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Berlin"]}},
                          "required": ["city"]}}
QUESTION = "What is the weather in Paris?"




def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def _text_session(url: str) -> dict[str, Any]:
    with _client(url) as client:
        whole = client.responses.create(model="default", input=QUESTION, max_output_tokens=64)
        with client.responses.stream(model="default", input=QUESTION, max_output_tokens=64) as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_response()
        short = client.responses.create(model="default", input=QUESTION, max_output_tokens=2)
    return {"whole": whole, "streamed": streamed, "kinds": kinds, "short": short}


async def test_text_whole_and_streamed_and_an_incomplete_answer(hello_model: Path) -> None:
    async with running_server(["--model", str(hello_model)]) as url:
        got = await trio.to_thread.run_sync(_text_session, url)
    for response in (got["whole"], got["streamed"]):
        assert (response.status, response.output_text) == ("completed", "Hello there, friend.")
        assert [item.type for item in response.output] == ["message"]
        assert response.usage.output_tokens == len(HELLO)
        assert response.usage.input_tokens == _rendered_length(hello_model, [{"role": "user", "content": QUESTION}])
    kinds = got["kinds"]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert {"response.output_item.added", "response.content_part.added", "response.output_text.delta",
            "response.output_text.done", "response.output_item.done"} <= set(kinds)
    short = got["short"]
    assert (short.status, short.output_text, short.incomplete_details.reason) == \
        ("incomplete", "Hello there", "max_output_tokens")


def _tool_session(url: str) -> dict[str, Any]:
    tools: Any = [WEATHER, {"type": "web_search"}]  # the second is not served: dropped
    with _client(url) as client:
        whole = client.responses.create(model="default", input=QUESTION, tools=tools)
        with client.responses.stream(model="default", input=QUESTION, tools=tools) as stream:
            streamed = stream.get_final_response()
        call = whole.output[-1]
        history: Any = [{"role": "user", "content": QUESTION},
                        {"type": "function_call", "call_id": call.call_id, "name": call.name,
                         "arguments": call.arguments},
                        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
        after = client.responses.create(model="default", input=history, tools=[WEATHER])  # type: ignore[list-item]
    return {"whole": whole, "streamed": streamed, "after": after, "call_id": call.call_id}


async def test_a_function_call_and_its_output_round_trip(caller_model: Path) -> None:
    import json

    async with running_server(["--model", str(caller_model)]) as url:
        got = await trio.to_thread.run_sync(_tool_session, url)
    for response in (got["whole"], got["streamed"]):
        message, call = response.output
        assert (message.type, response.output_text) == ("message", "Checking.")
        assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather",
                                                                      {"city": "Paris"})
        assert call.call_id.startswith("call_") and call.status == "completed"
    twin = [{"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "", "tool_calls": [{"id": got["call_id"], "type": "function", "function": {
                "name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "tool_call_id": got["call_id"], "content": "Sunny, 21 C"}]
    tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    assert got["after"].usage.input_tokens == _rendered_length(caller_model, twin, tools)


CODEX_FIELDS: dict[str, Any] = {
    "instructions": "You are Codex.", "tool_choice": "auto", "parallel_tool_calls": False,
    "reasoning": {"summary": "auto"}, "include": ["reasoning.encrypted_content"], "store": False,
    "prompt_cache_key": "7f1c", "stream": False,
    "tools": [WEATHER, {"type": "namespace", "name": "mcp", "tools": []}, {"type": "web_search"}],
}


async def test_what_codex_sends_is_accepted_and_errors_are_clear(hello_model: Path) -> None:
    codex_input = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
                   {"type": "message", "role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
                   {"type": "reasoning", "summary": [], "encrypted_content": "opaque"}]
    async with running_server(["--model", str(hello_model)]) as url, \
            httpx.AsyncClient(base_url=url, timeout=60) as client:
        body = {"model": hello_model.name, "input": codex_input, **CODEX_FIELDS}
        answer = await client.post("/v1/responses", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.json()["output_text"] == "Hello there, friend."
        system = [{"role": "system", "content": "You are Codex.\n\nBe brief."}, {"role": "user", "content": QUESTION}]
        assert answer.json()["usage"]["input_tokens"] == _rendered_length(
            hello_model, system, [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}])
        stored = await client.post("/v1/responses", json={"input": QUESTION, "previous_response_id": "resp_1"})
        unknown = await client.post("/v1/responses", json={"model": "gpt-5", "input": QUESTION})
        image = await client.post("/v1/responses", json={"input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64," + TINY_PNG}]}]})
    assert stored.status_code == 400 and stored.json()["error"]["param"] == "previous_response_id"
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert image.status_code == 400 and "text only" in image.json()["error"]["message"]
