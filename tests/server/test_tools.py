"""Tool calling through real HTTP and the ``openai`` client: templates, parsing, streaming, forced calls.

``auto`` is served by a llama built to answer every chat with a fixed text that
holds a Hermes-format call (``mlxcel/testing/tools.py``): the template
rendering, mlx-lm's parser and the streaming reader are the real ones. Forced
calls (a named function, ``required``) run a random llama under the grammar.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio
from openai.lib.streaming.chat import ChatCompletionStreamState

from mlxcel.testing.base import TOOLS_CHATML
from mlxcel.testing.checkpoints import build_checkpoint
from mlxcel.testing.tools import build_scripted_checkpoint
from tests.server.conftest import running_server

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Berlin"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}},
                                       "required": ["utc"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_scripted_checkpoint(tmp_path_factory.mktemp("tools") / "scripted")


@pytest.fixture(scope="module")
def tool_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("tools") / "llama", "llama", scale=2.0,
                            chat_template=TOOLS_CHATML)


def _prompt_length(checkpoint: Path, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """The tokens of the chat as the model's own tokenizer renders it (transformers' apply_chat_template)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def _whole_and_streamed(url: str, **request: Any) -> tuple[Any, Any, list[Any]]:
    """The request through the `openai` client, whole and streamed; the stream assembled by the client's own
    accumulator (what ``client.chat.completions.stream`` uses), and its chunks."""
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        whole = client.chat.completions.create(model="default", temperature=0, max_tokens=40, **request)
        state = ChatCompletionStreamState()
        chunks = []
        for chunk in client.chat.completions.create(model="default", temperature=0, max_tokens=40, stream=True,
                                                    **request):
            chunks.append(chunk)
            state.handle_chunk(chunk)
        return whole, state.get_final_completion(), chunks


def _calls(completion: Any) -> list[tuple[str, Any]]:
    message = completion.choices[0].message
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


async def test_auto_parses_the_models_own_format_whole_and_streamed(scripted: Path) -> None:
    async with running_server(["--model", str(scripted)]) as url:
        whole, streamed, chunks = await trio.to_thread.run_sync(
            lambda: _whole_and_streamed(url, messages=ASK, tools=[WEATHER, TIME]))
    for completion in (whole, streamed):
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Checking."
        assert _calls(completion) == [("get_weather", {"city": "Paris"})]
        assert choice.message.tool_calls[0].id.startswith("call_")
    # The call came as tool-call deltas, never as content.
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert any(d.tool_calls for d in deltas) and "<tool_call>" not in "".join(d.content or "" for d in deltas)
    assert whole.usage.prompt_tokens == _prompt_length(scripted, ASK, [WEATHER, TIME])


HERMES_INSTRUCTION = 'Call a function as <tool_call>{"name": <name>, "arguments": <object>}</tool_call>'
OTHER_FORMATS = {
    # mlx-lm's gemma4 parser: "<|tool_call>" and "<tool_call|>" in the template; strings in <|"|>.
    "gemma4": ("Call a function as <|tool_call>call:name{key:value}<tool_call|>",
               ("<|tool_call>", 'call:get_weather{city:<|"|>Paris<|"|>}', "<tool_call|>")),
    # mlx-lm's glm47 parser: "<arg_key>" in the template.
    "glm47": ("Call a function as <tool_call>name<arg_key>key</arg_key><arg_value>value</arg_value></tool_call>",
              ("<tool_call>", "get_weather<arg_key>city</arg_key>", "<arg_value>Paris</arg_value>", "</tool_call>")),
}


@pytest.mark.parametrize("family_format", sorted(OTHER_FORMATS))
async def test_auto_reads_gemma4_and_glm_calls(family_format: str, tmp_path: Path) -> None:
    instruction, script = OTHER_FORMATS[family_format]
    checkpoint = build_scripted_checkpoint(tmp_path / family_format, script,
                                           TOOLS_CHATML.replace(HERMES_INSTRUCTION, instruction))
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    assert load_tokenizer(checkpoint).tool_call_start == script[0]  # mlx-lm picked that family's parser
    async with running_server(["--model", str(checkpoint)]) as url:
        whole, streamed, _ = await trio.to_thread.run_sync(
            lambda: _whole_and_streamed(url, messages=ASK, tools=[WEATHER]))
    for completion in (whole, streamed):
        assert completion.choices[0].finish_reason == "tool_calls"
        assert completion.choices[0].message.content is None
        assert _calls(completion) == [("get_weather", {"city": "Paris"})]


async def test_tool_choice_none_history_and_refusals(scripted: Path, llama: Path) -> None:
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    async with running_server(["--model", str(scripted)]) as url, httpx.AsyncClient(timeout=60) as client:
        async def chat(**body: Any) -> httpx.Response:
            return await client.post(f"{url}/v1/chat/completions",
                                     json={"max_tokens": 40, "temperature": 0, **body})

        # none: the tools are not rendered and the text is not read for calls.
        plain = (await chat(messages=ASK, tools=[WEATHER], tool_choice="none")).json()
        assert plain["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in plain["choices"][0]["message"]
        assert plain["choices"][0]["message"]["content"].startswith("Checking.<tool_call>")
        assert plain["usage"]["prompt_tokens"] == _prompt_length(scripted, ASK, None)
        # An assistant's earlier calls and the tool's answer go through the template.
        answered = (await chat(messages=history, tools=[WEATHER]))
        assert answered.status_code == 200, answered.text
        template_history = [*history[:1], {**history[1], "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            history[2]]
        assert answered.json()["usage"]["prompt_tokens"] == _prompt_length(scripted, template_history, [WEATHER])

        for body, param in [({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tools"),
                            ({"tool_choice": "required", "tools": None}, "tool_choice"),
                            ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
                            ({"response_format": {"type": "json_object"}}, "response_format")]:
            refused = await chat(messages=ASK, **{"tools": [WEATHER], **body})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param, (body, refused.text)
        completion = await client.post(f"{url}/v1/completions", json={"prompt": "x", "tools": [WEATHER]})
        assert completion.status_code == 400 and completion.json()["error"]["code"] == "unsupported_parameter"
    # A template that does not render tools: a 400, not a silent text answer.
    async with running_server(["--model", str(llama)]) as url, httpx.AsyncClient(timeout=60) as client:
        refused = await client.post(f"{url}/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]})
        assert refused.status_code == 400 and "does not render tools" in refused.json()["error"]["message"]


async def test_forced_calls_follow_the_tools_schemas(tool_llama: Path) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    results = []
    async with running_server(["--model", str(tool_llama)]) as url:
        for choice in (named, "required"):
            # parallel_tool_calls false: exactly one call (a random model would list calls to max_tokens).
            results.append(await trio.to_thread.run_sync(lambda c=choice: _whole_and_streamed(
                url, messages=ASK, tools=[WEATHER, TIME], tool_choice=c, parallel_tool_calls=False)))
    (named_whole, named_streamed, named_chunks), (required_whole, required_streamed, _) = results
    # A named function: one call of it, its arguments valid for its parameters, streamed as they came.
    for completion in (named_whole, named_streamed):
        assert completion.choices[0].finish_reason == "tool_calls" and completion.choices[0].message.content is None
        ((name, arguments),) = _calls(completion)
        assert name == "get_weather" and arguments in ({"city": "Paris"}, {"city": "Berlin"})
    assert _calls(named_whole) == _calls(named_streamed)
    assert sum(1 for c in named_chunks if c.choices and c.choices[0].delta.tool_calls) > 1
    # required: a call of a listed tool, with arguments valid for it.
    for completion in (required_whole, required_streamed):
        assert completion.choices[0].finish_reason == "tool_calls"
        calls = _calls(completion)
        assert len(calls) == 1 and all(
            (n == "get_weather" and a in ({"city": "Paris"}, {"city": "Berlin"}))
            or (n == "get_time" and set(a) == {"utc"} and isinstance(a["utc"], bool)) for n, a in calls)
    assert _calls(required_whole) == _calls(required_streamed)


def test_the_reader_holds_back_split_markers_and_keeps_unreadable_calls_as_text() -> None:
    from mlx_lm.tool_parsers import json_tools

    from mlxcel.server.tools import ToolCallReader, ToolSetup

    setup = ToolSetup("auto", [WEATHER], start=json_tools.tool_call_start, end=json_tools.tool_call_end,
                      parse=json_tools.parse_tool_call)
    text = 'a <tool_call>{"name": "get_weather", "arguments": {"city": "Berlin"}}</tool_call> b <tool_call>oops'
    for pieces in ([text], list(text)):  # whole, and one character at a time (markers split across deltas)
        reader = ToolCallReader(setup)
        content, deltas = "", []
        for piece in pieces:
            more, calls = reader.feed(piece)
            assert "<" not in more or more.startswith("<tool_call>oops")  # no half marker leaks out
            content, deltas = content + more, deltas + calls
        rest, calls = reader.finish()
        content, deltas = content + rest, deltas + calls
        assert content == "a  b <tool_call>oops"  # a call cut off stays text, and so does the text around calls
        assert [(d["index"], d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == \
            [(0, "get_weather", {"city": "Berlin"})]
        assert reader.calls[0]["id"] == deltas[0]["id"]
