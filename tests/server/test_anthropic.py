"""Anthropic's Messages API through the official ``anthropic`` SDK, against a real server.

The models answer every chat with a scripted reply (``mlxcel/testing/tools.py``),
so every assertion is exact: the text, the tool call, where it stops and why.
The prompt's token counts are checked against transformers' own rendering of
the same conversation, an oracle independent of mlxcel.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.server.conftest import HELLO, TINY_PNG, anthropic_client, running_server

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Berlin"]}},
                            "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _rendered_length(checkpoint: Path, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
                     ) -> int:
    """The prompt's tokens as transformers renders the same conversation with the model's template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


def _text_session(url: str) -> dict[str, Any]:
    with anthropic_client(url) as client:
        whole = client.messages.create(model="claude-sonnet-4-5", max_tokens=64, messages=ASK)
        with client.messages.stream(model="claude-sonnet-4-5", max_tokens=64, messages=ASK) as stream:
            kinds = [event.type for event in stream]
            streamed = stream.get_final_message()
        short = client.messages.create(model="default", max_tokens=2, messages=ASK)
        stopped = client.messages.create(model="default", max_tokens=64, messages=ASK, stop_sequences=[" friend"])
        counted = client.messages.count_tokens(model="claude-haiku-4-5", messages=ASK)
    return {"whole": whole, "streamed": streamed, "kinds": kinds, "short": short, "stopped": stopped,
            "counted": counted}


async def test_text_whole_and_streamed_with_its_stop_reasons_and_usage(hello_model: Path) -> None:
    async with running_server(["--model", str(hello_model)]) as url:
        got = await trio.to_thread.run_sync(_text_session, url)
    whole, streamed = got["whole"], got["streamed"]
    for message in (whole, streamed):
        assert [(b.type, b.text) for b in message.content] == [("text", "Hello there, friend.")]
        assert (message.role, message.stop_reason, message.stop_sequence) == ("assistant", "end_turn", None)
        assert message.model == "claude-sonnet-4-5" and message.id.startswith("msg_")
        assert message.usage.output_tokens == len(HELLO)
    prompt = _rendered_length(hello_model, ASK)
    assert whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0) == prompt
    assert got["counted"].input_tokens == prompt
    assert got["kinds"][0] == "message_start" and got["kinds"][-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(got["kinds"])
    short = got["short"]
    assert (short.content[0].text, short.stop_reason, short.usage.output_tokens) == ("Hello there", "max_tokens", 2)
    stopped = got["stopped"]
    assert (stopped.content[0].text, stopped.stop_reason, stopped.stop_sequence) == \
        ("Hello there,", "stop_sequence", " friend")


def _tool_session(url: str) -> dict[str, Any]:
    with anthropic_client(url) as client:
        whole = client.messages.create(model="default", max_tokens=64, messages=ASK, tools=[WEATHER])
        with client.messages.stream(model="default", max_tokens=64, messages=ASK, tools=[WEATHER]) as stream:
            streamed = stream.get_final_message()
        use = whole.content[-1]
        history = [*ASK, {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                                           {"type": "tool_use", "id": use.id, "name": use.name,
                                                            "input": use.input}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                 "content": [{"type": "text", "text": "Sunny, 21 C"}]}]}]
        after = client.messages.create(model="default", max_tokens=64, messages=history, tools=[WEATHER])
        counted = client.messages.count_tokens(model="default", messages=history, tools=[WEATHER])
    return {"whole": whole, "streamed": streamed, "after": after, "counted": counted, "use_id": use.id}


async def test_a_tool_call_and_its_result_round_trip(caller_model: Path) -> None:
    async with running_server(["--model", str(caller_model)]) as url:
        got = await trio.to_thread.run_sync(_tool_session, url)
    for message in (got["whole"], got["streamed"]):
        assert message.stop_reason == "tool_use"
        text, use = message.content
        assert (text.type, text.text) == ("text", "Checking.")
        assert (use.type, use.name, use.input) == ("tool_use", "get_weather", {"city": "Paris"})
        assert use.id.startswith("toolu_")
    assert got["after"].stop_reason == "tool_use"  # the script calls again; the history was served
    # The history renders as transformers renders its chat-completions twin: call, then the tool's result.
    twin = [*ASK, {"role": "assistant", "content": "Checking.", "tool_calls": [{
        "id": got["use_id"], "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": got["use_id"], "content": "Sunny, 21 C"}]
    tools = [{"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    assert got["counted"].input_tokens == _rendered_length(caller_model, twin, tools)


CLAUDE_CODE_FIELDS: dict[str, Any] = {
    "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=abc123;"},
               {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
    "thinking": {"type": "adaptive"}, "context_management": {"edits": []}, "output_config": {"effort": "high"},
    "metadata": {"user_id": "someone"}, "stream": False, "max_tokens": 32000,
}


async def test_what_claude_code_sends_is_accepted_and_the_billing_line_never_reaches_the_model(
        hello_model: Path) -> None:
    messages = [{"role": "system", "content": "Be brief."}, *ASK]
    async with running_server(["--model", str(hello_model)]) as url, \
            httpx.AsyncClient(base_url=url, timeout=60) as client:
        headers = {"anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14"}
        answer = await client.post("/v1/messages?beta=true", headers=headers,
                                   json={"model": "claude-opus-4-5", "messages": messages, **CLAUDE_CODE_FIELDS})
        assert answer.status_code == 200, answer.text
        assert answer.json()["content"] == [{"type": "text", "text": "Hello there, friend."}]
        counts = []
        for billing in ("cch=abc123", "cch=zzz999"):
            system = [{**CLAUDE_CODE_FIELDS["system"][0], "text": f"x-anthropic-billing-header: {billing};"},
                      CLAUDE_CODE_FIELDS["system"][1]]
            counted = await client.post("/v1/messages/count_tokens", headers=headers,
                                        json={"model": "claude-opus-4-5", "messages": messages, "system": system})
            counts.append(counted.json()["input_tokens"])
    # The system prompt the model sees: the coding-agent block and the in-conversation system message only.
    system = {"role": "system", "content": "You are a coding agent.\nBe brief."}
    expected = _rendered_length(hello_model, [system, *ASK])
    assert counts == [expected, expected]


def _error_session(url: str) -> dict[str, Any]:
    import anthropic

    caught: dict[str, Any] = {}
    with anthropic_client(url, key="the-key") as client:
        for name, call in {
            "model": lambda: client.messages.create(model="gpt-4o", max_tokens=8, messages=ASK),
            "image": lambda: client.messages.create(model="default", max_tokens=8, messages=[{
                "role": "user", "content": [{"type": "image", "source": {
                    "type": "base64", "media_type": "image/png", "data": TINY_PNG}}]}]),
            "max_tokens": lambda: client.messages.create(model="default", max_tokens=0, messages=ASK),
        }.items():
            try:
                call()
            except anthropic.APIStatusError as exc:
                caught[name] = exc
    with anthropic_client(url, key="wrong") as client:
        try:
            client.messages.create(model="default", max_tokens=8, messages=ASK)
        except anthropic.APIStatusError as exc:
            caught["key"] = exc
    return caught


async def test_errors_are_anthropic_shaped_with_the_matching_status_and_both_key_headers_pass(
        hello_model: Path) -> None:
    import anthropic

    async with running_server(["--model", str(hello_model), "--api-key", "the-key"]) as url:
        caught = await trio.to_thread.run_sync(_error_session, url)
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            bearer = await client.post("/v1/messages", headers={"Authorization": "Bearer the-key"},
                                       json={"model": "default", "max_tokens": 2, "messages": ASK})
            broken = await client.post("/v1/messages", headers={"x-api-key": "the-key"}, content=b"{not json")
    assert isinstance(caught["model"], anthropic.NotFoundError)
    assert isinstance(caught["image"], anthropic.BadRequestError) and "text only" in caught["image"].message
    assert isinstance(caught["max_tokens"], anthropic.BadRequestError)
    assert isinstance(caught["key"], anthropic.AuthenticationError)
    for error in caught.values():
        body = error.response.json()
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert caught["key"].response.json()["error"]["type"] == "authentication_error"
    assert bearer.status_code == 200
    assert broken.status_code == 400 and broken.json()["error"]["type"] == "invalid_request_error"


async def _message_texts(model: Path, monkeypatch: pytest.MonkeyPatch, pin: str) -> tuple[list[str], float]:
    """Greedy /v1/messages (whole and streamed) and /v1/responses answers at two lengths, and the drafts the
    server proposed."""
    from prometheus_client.parser import text_string_to_metric_families

    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", pin)
    monkeypatch.setenv("MLXCEL_DRAFT_BLOCK_SIZE", "3")
    texts = []
    async with running_server(["--model", str(model), "--mtp", "--metrics"]) as url, \
            httpx.AsyncClient(base_url=url, timeout=120) as client:
        for question in ("Write a loop.", "Name three colours."):
            for max_tokens in (7, 60):
                body = {"model": "default", "max_tokens": max_tokens, "temperature": 0,
                        "messages": [{"role": "user", "content": question}]}
                whole = (await client.post("/v1/messages", json=body)).json()
                streamed = ""
                async with client.stream("POST", "/v1/messages", json={**body, "stream": True}) as response:
                    async for line in response.aiter_lines():
                        if line.startswith("data: ") and '"text_delta"' in line:
                            streamed += json.loads(line[6:])["delta"]["text"]
                responses = (await client.post("/v1/responses", json={
                    "max_output_tokens": max_tokens, "temperature": 0, "input": question})).json()
                texts += [whole["content"][0]["text"] if whole["content"] else "", streamed, responses["output_text"]]
        metrics = (await client.get("/metrics")).text
    (drafts,) = [f for f in text_string_to_metric_families(metrics) if f.name == "mlxcel_draft_tokens"]
    return texts, float(drafts.samples[0].value)


async def test_temperature_zero_messages_and_responses_are_byte_identical_with_and_without_mtp(
        tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint

    model = build_mtp_checkpoint(tmp_path_factory.mktemp("anthropic") / "qwen35-partial", drafter="aligned",
                                 context_scale=0.05)
    classic, none_drafted = await _message_texts(model, monkeypatch, "0")
    speculative, drafted = await _message_texts(model, monkeypatch, "1")
    assert speculative == classic and none_drafted == 0 < drafted
    assert all(classic) and len(set(classic)) > 2  # real text, different per question and length
    # Per question and length: Messages whole, Messages streamed and Responses all say the same.
    assert all(classic[i] == classic[i + 1] == classic[i + 2] for i in range(0, len(classic), 3))


async def test_a_stream_pings_while_nothing_comes_and_never_times_out_its_reader(
        autojump_clock: trio.abc.Clock) -> None:
    from mlxcel.server.anthropic_routes import PING_SECONDS, _with_pings

    send, receive = trio.open_memory_channel[tuple[int, object]](1)

    async def engine() -> None:
        await trio.sleep(2.5 * PING_SECONDS)  # a long prefill
        await send.send((0, "first"))
        await send.aclose()

    seen: list[tuple[float, object]] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine)
        async for event in _with_pings(receive):
            seen.append((trio.current_time(), event))
            await trio.sleep(3 * PING_SECONDS)  # a slow reader: the ping timeout must not cover its time
    assert [event for _, event in seen] == [None, "first"]
    assert seen[0][0] == pytest.approx(PING_SECONDS)
