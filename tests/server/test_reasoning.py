"""A thinking model's reasoning through every chat-shaped route, and the switches that reach its template.

The model is scripted (``mlxcel/testing/tools.py``): its template opens a
``<think>`` block at the end of the generation prompt unless ``enable_thinking``
is false, as Qwen 3.5's does, and it answers every chat with "Let me see." and
``</think>``, then "Hello there.". With the block open, the first is reasoning
and the rest the answer; with it closed, all of it is the answer, markers and
all. Prompt sizes are checked against transformers' own rendering with the same
template variables, an oracle independent of mlxcel.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from mlxcel.testing.base import THINKING_CHATML
from tests.server.conftest import anthropic_client, running_server

SCRIPT = ("Let me see.", "</think>", "Hello", " there", ".")
REASONING, ANSWER, UNSPLIT = "Let me see.", "Hello there.", "Let me see.</think>Hello there."
ASK: Any = [{"role": "user", "content": "Hi"}]
EARLIER: Any = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
           {"role": "user", "content": "Again"}]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlxcel.testing.tools import build_scripted_checkpoint

    return build_scripted_checkpoint(tmp_path_factory.mktemp("scripted") / "thinker", SCRIPT, THINKING_CHATML,
                                     markers=("<think>", "</think>"))


def _rendered_length(checkpoint: Path, messages: list[dict[str, Any]], **kwargs: Any) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    return len(tokenizer.encode(text, add_special_tokens=False))


def _with_reasoning(key: str) -> list[dict[str, Any]]:
    """:data:`EARLIER`, the assistant's turn carrying its reasoning under *key*."""
    return [EARLIER[0], {**EARLIER[1], key: "I was greeted."}, EARLIER[2]]


def _chat_session(url: str) -> dict[str, Any]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        whole = client.chat.completions.create(model="default", messages=ASK)
        stream = client.chat.completions.create(model="default", messages=ASK, stream=True)
        deltas = [chunk.choices[0].delta.model_dump() for chunk in stream if chunk.choices]
        switch = {"chat_template_kwargs": {"enable_thinking": False}}
        off = client.chat.completions.create(model="default", messages=ASK, extra_body=switch)
        effort = client.chat.completions.create(model="default", messages=ASK, reasoning_effort="none")
        history = {key: client.chat.completions.create(
            model="default", messages=_with_reasoning(key), max_tokens=1).usage
            for key in ("reasoning_content", "reasoning")}
    return {"whole": whole, "deltas": deltas, "off": off, "effort": effort, "history": history}


async def test_chat_completions_send_the_reasoning_under_both_names_and_take_it_back(thinker: Path) -> None:
    async with running_server(["--model", str(thinker)]) as url:
        got = await trio.to_thread.run_sync(_chat_session, url)
        async with httpx.AsyncClient(base_url=url) as client:
            reserved = await client.post("/v1/chat/completions", json={
                "messages": ASK, "chat_template_kwargs": {"add_generation_prompt": False}})
    message = got["whole"].choices[0].message.model_dump()
    assert (message["reasoning_content"], message["reasoning"], message["content"]) == (REASONING, REASONING, ANSWER)
    assert got["whole"].usage.prompt_tokens == _rendered_length(thinker, ASK)
    streamed = got["deltas"]
    assert "".join(d.get("reasoning_content") or "" for d in streamed) == REASONING
    assert "".join(d.get("reasoning") or "" for d in streamed) == REASONING
    assert "".join(d.get("content") or "" for d in streamed) == ANSWER
    assert streamed[0]["role"] == "assistant"
    for switched in (got["off"], got["effort"]):  # the template closed nothing: all of it is the answer
        message = switched.choices[0].message.model_dump()
        assert (message["content"], message.get("reasoning_content")) == (UNSPLIT, None)
        assert switched.usage.prompt_tokens == _rendered_length(thinker, ASK, enable_thinking=False)
    for usage in got["history"].values():  # either name renders the earlier reasoning back
        assert usage.prompt_tokens == _rendered_length(thinker, _with_reasoning("reasoning_content"))
    assert usage.prompt_tokens > _rendered_length(thinker, EARLIER)
    assert reserved.status_code == 400 and "set by the server" in reserved.json()["error"]["message"]


def _anthropic_session(url: str) -> dict[str, Any]:
    with anthropic_client(url) as client:
        whole = client.messages.create(model="claude-sonnet-4-5", max_tokens=64, messages=ASK,
                                       thinking={"type": "enabled", "budget_tokens": 1024})
        with client.messages.stream(model="default", max_tokens=64, messages=ASK) as stream:
            kinds = [(event.type, getattr(getattr(event, "delta", None), "type", None)) for event in stream]
            streamed = stream.get_final_message()
        off = client.messages.create(model="default", max_tokens=64, messages=ASK,
                                     thinking={"type": "disabled"})
        history: Any = [EARLIER[0], {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "I was greeted.", "signature": "opaque"},
            {"type": "text", "text": "Hello."}]}, EARLIER[2]]
        counted = client.messages.count_tokens(model="default", messages=history)
    return {"whole": whole, "streamed": streamed, "kinds": kinds, "off": off, "counted": counted}


async def test_messages_answer_with_a_thinking_block_first(thinker: Path) -> None:
    async with running_server(["--model", str(thinker)]) as url:
        got = await trio.to_thread.run_sync(_anthropic_session, url)
    for message in (got["whole"], got["streamed"]):
        assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in message.content] == \
            [("thinking", REASONING), ("text", ANSWER)]
        assert message.stop_reason == "end_turn" and message.usage.output_tokens == len(SCRIPT)
    assert ("content_block_delta", "thinking_delta") in got["kinds"]
    assert ("content_block_delta", "text_delta") in got["kinds"]
    assert [(b.type, b.text) for b in got["off"].content] == [("text", UNSPLIT)]
    assert got["counted"].input_tokens == _rendered_length(thinker, _with_reasoning("reasoning_content"))


def _responses_session(url: str) -> dict[str, Any]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        whole = client.responses.create(model="default", input="Hi", reasoning={"summary": "auto"})
        with client.responses.stream(model="default", input="Hi") as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_response()
        off = client.responses.create(model="default", input="Hi", reasoning={"effort": "none"})
        item = whole.output[0].model_dump(exclude_none=True)
        history: Any = [EARLIER[0], item, {"role": "assistant", "content": "Hello."}, EARLIER[2]]
        again = client.responses.create(model="default", input=history, max_output_tokens=1)
    return {"whole": whole, "streamed": streamed, "kinds": kinds, "off": off, "again": again}


async def test_responses_answer_with_a_reasoning_item_first(thinker: Path) -> None:
    async with running_server(["--model", str(thinker)]) as url:
        got = await trio.to_thread.run_sync(_responses_session, url)
    for response in (got["whole"], got["streamed"]):
        reasoning, message = response.output
        assert reasoning.type == "reasoning" and [c.text for c in reasoning.content] == [REASONING]
        assert (message.type, response.output_text) == ("message", ANSWER)
        assert response.usage.output_tokens_details.reasoning_tokens == 2  # "Let me see." and "</think>"
    assert {"response.reasoning_text.delta", "response.reasoning_text.done"} <= set(got["kinds"])
    assert kinds_before(got["kinds"], "response.reasoning_text.delta", "response.output_text.delta")
    off = got["off"]
    assert ([item.type for item in off.output], off.output_text) == (["message"], UNSPLIT)
    assert off.reasoning.effort == "none" and off.usage.output_tokens_details.reasoning_tokens == 0
    # The reasoning item passed back is rendered with the assistant turn it led to.
    passed_back = [EARLIER[0], {**EARLIER[1], "reasoning_content": REASONING}, EARLIER[2]]
    assert got["again"].usage.input_tokens == _rendered_length(thinker, passed_back)


def kinds_before(kinds: list[str], first: str, then: str) -> bool:
    return kinds.index(first) < kinds.index(then)


async def test_a_grammar_decides_the_output_from_its_first_token_so_none_of_it_is_reasoning(thinker: Path) -> None:
    async with running_server(["--model", str(thinker)]) as url, httpx.AsyncClient(base_url=url) as client:
        response = await client.post("/v1/chat/completions", json={
            "messages": ASK, "max_tokens": 64, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "flag", "schema": {
                "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                "additionalProperties": False}}}})
    choice = response.json()["choices"][0]
    assert "reasoning_content" not in choice["message"] and choice["finish_reason"] == "stop"
    assert list(json.loads(choice["message"]["content"])) == ["ok"]
