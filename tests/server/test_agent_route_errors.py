"""The agent routes' client errors: ``/v1/messages`` and ``/v1/responses`` answer a malformed body with a 4xx in
their own shape that names the field, never a 500; hypothesis looks for the next gap.

One server for the module (:func:`server_on_a_thread`), spoken to with a synchronous ``httpx`` client.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import TINY_PNG
from tests.server.test_fuzz import WILD

ASK = [{"role": "user", "content": "Hi?"}]
PNG = {"type": "base64", "media_type": "image/png", "data": TINY_PNG}


@pytest.fixture
def client(hello_client: httpx.Client) -> httpx.Client:
    return hello_client


def _anthropic_error(response: httpx.Response) -> dict[str, Any]:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:400])
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] != "api_error", body
    return body["error"]


def _openai_error(response: httpx.Response) -> dict[str, Any]:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:400])
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def _messages(*content: Any, role: str = "user") -> dict[str, Any]:
    return {"model": "default", "max_tokens": 2, "messages": [{"role": role, "content": list(content)}]}


CALLED = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}

MALFORMED_BLOCKS: list[tuple[dict[str, Any], str]] = [
    (_messages({"type": "text"}), "messages.0.content.0.text.text"),
    (_messages({"type": "text", "text": 5}), "messages.0.content.0.text.text"),
    (_messages({"type": "tool_use", "name": "f", "input": {}}, role="assistant"), "tool_use.id"),
    (_messages({"type": "tool_use", "id": "t", "input": {}}, role="assistant"), "tool_use.name"),
    (_messages({"type": "tool_use", "id": "t", "name": "f"}, role="assistant"), "tool_use.input"),
    (_messages({"type": "tool_use", "id": "t", "name": "f", "input": "s"}, role="assistant"), "tool_use.input"),
    (_messages({"type": "tool_result", "content": "x"}), "tool_result.tool_use_id"),
    (_messages({"type": "tool_result", "tool_use_id": "t", "content": [5]}), "tool_result.content"),
    (_messages({"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}), "tool_result.is_error"),
    (_messages({"type": "thinking", "thinking": 5}, role="assistant"), "thinking.thinking"),
    (_messages({"text": "no type"}), "messages.0.content.0"),
    (_messages(7), "messages.0.content.0"),
]


@pytest.mark.parametrize(("body", "field"), MALFORMED_BLOCKS)
def test_a_malformed_messages_block_is_a_400_that_names_its_field(client: httpx.Client, body: dict[str, Any],
                                                                  field: str) -> None:
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        error = _anthropic_error(client.post(path, json=body))
        assert error["type"] == "invalid_request_error" and field in error["message"], (path, error)


MALFORMED_TOOLS: list[tuple[Any, str]] = [
    ({"type": "function", "parameters": {}}, "tools.0.function.name"),
    ({"type": "function", "name": "bad name"}, "tools.0.function.name"),
    ({"type": "function", "name": "f", "parameters": 5}, "tools.0.function.parameters"),
    ({"name": "f"}, "tools.0"),
    (5, "tools.0"),
]


@pytest.mark.parametrize(("tool", "field"), MALFORMED_TOOLS)
def test_a_malformed_responses_tool_is_a_400_that_names_its_field(client: httpx.Client, tool: Any,
                                                                  field: str) -> None:
    error = _openai_error(client.post("/v1/responses", json={"input": "Hi?", "tools": [tool]}))
    assert error["type"] == "invalid_request_error" and field in error["message"] and error["param"] == "tools"


def test_an_image_is_refused_wherever_anthropic_allows_one(client: httpx.Client) -> None:
    inside_result = _messages({"type": "tool_result", "tool_use_id": "toolu_1",
                               "content": [{"type": "text", "text": "see"}, {"type": "image", "source": PNG}]})
    inside_result["messages"][:0] = [{"role": "user", "content": "go"}, CALLED]
    in_system_turn = {"model": "default", "max_tokens": 2, "messages": [
        {"role": "system", "content": [{"type": "image", "source": PNG}]}, *ASK]}
    for body in (inside_result, in_system_turn):
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            error = _anthropic_error(client.post(path, json=body))
            assert "text only" in error["message"], (path, error)


def test_a_forced_tool_choice_without_tools_is_the_same_400_on_every_route(client: httpx.Client) -> None:
    refused = [
        client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, "tool_choice": "required"}),
        client.post("/v1/messages", json={**_messages({"type": "text", "text": "Hi?"}),
                                          "tool_choice": {"type": "any"}}),
        client.post("/v1/messages", json={**_messages({"type": "text", "text": "Hi?"}),
                                          "tool_choice": {"type": "tool", "name": "f"}}),
        client.post("/v1/messages/count_tokens", json={"model": "default", "messages": ASK,
                                                       "tool_choice": {"type": "any"}}),
        client.post("/v1/responses", json={"input": "Hi?", "tool_choice": "required"}),
        client.post("/v1/responses", json={"input": "Hi?", "tool_choice": {"type": "function", "name": "f"}}),
    ]
    messages = {(r.json().get("error") or {}).get("message") for r in refused}
    assert [r.status_code for r in refused] == [400] * 6 and messages == {"tool_choice needs tools"}, messages
    fine = client.post("/v1/messages", json={**_messages({"type": "text", "text": "Hi?"}),
                                             "tool_choice": {"type": "auto"}})
    assert fine.status_code == 200, fine.text


def test_count_tokens_knows_the_served_models_as_messages_does(client: httpx.Client) -> None:
    body = {"model": "gpt-4", "messages": ASK}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        response = client.post(path, json={**body, "max_tokens": 2})
        assert response.status_code == 404 and _anthropic_error(response)["type"] == "not_found_error"
    assert client.post("/v1/messages/count_tokens", json={**body, "model": "claude-haiku-4-5"}).status_code == 200


def test_a_conversation_of_only_a_system_message_is_a_400(client: httpx.Client) -> None:
    only_system = {"model": "default", "max_tokens": 2, "messages": [{"role": "system", "content": "Be brief."}]}
    assert "no user or assistant turn" in _anthropic_error(client.post("/v1/messages", json=only_system))["message"]
    developer = client.post("/v1/responses", json={"instructions": "Be brief.", "input": [
        {"type": "message", "role": "developer", "content": "Be brief."}]})
    assert "no user or assistant turn" in _openai_error(developer)["message"]


def test_a_wrong_method_on_the_messages_routes_is_the_clients_error(client: httpx.Client) -> None:
    response = client.get("/v1/messages")
    assert response.status_code == 405 and _anthropic_error(response)["type"] == "invalid_request_error"


# -- hypothesis: any body gets a 2xx or a clean 4xx in the route's shape -----------------------------------------

TEXT = st.text(max_size=12)
NAME = st.sampled_from(["get_weather", "f"])
TEXT_BLOCK = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
TOOL_USE = st.fixed_dictionaries({"type": st.just("tool_use"), "id": TEXT, "name": NAME,
                                  "input": st.dictionaries(TEXT, TEXT, max_size=2)})
TOOL_RESULT = st.fixed_dictionaries({"type": st.just("tool_result"), "tool_use_id": TEXT},
                                    optional={"content": TEXT | st.lists(TEXT_BLOCK, max_size=2),
                                              "is_error": st.booleans()})
THINKING = st.fixed_dictionaries({"type": st.just("thinking"), "thinking": TEXT, "signature": st.just("")})
USER = st.fixed_dictionaries({"role": st.just("user"),
                              "content": TEXT | st.lists(TEXT_BLOCK | TOOL_RESULT, min_size=1, max_size=3)})
ASSISTANT = st.fixed_dictionaries({"role": st.just("assistant"), "content": TEXT | st.lists(
    TEXT_BLOCK | TOOL_USE | THINKING | st.just({"type": "redacted_thinking", "data": "x"}), min_size=1, max_size=3)})
MESSAGES_BODY = st.fixed_dictionaries(
    {"model": st.sampled_from(["default", "claude-sonnet-4-5"]), "max_tokens": st.integers(1, 3),
     "messages": st.tuples(USER, st.lists(st.tuples(ASSISTANT, USER), max_size=2)).map(
         lambda turns: [turns[0], *(m for pair in turns[1] for m in pair)])},
    optional={"system": TEXT | st.lists(TEXT_BLOCK, max_size=2), "stop_sequences": st.lists(TEXT, max_size=2),
              "temperature": st.floats(0, 1), "stream": st.booleans(),
              "tools": st.lists(st.fixed_dictionaries({"name": NAME, "input_schema": st.just({"type": "object"})},
                                                      optional={"description": TEXT}), min_size=1, max_size=2),
              "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "none"])}),
              "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled"])})})
INPUT_TEXT = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text"]), "text": TEXT})
ITEM = st.one_of(
    st.fixed_dictionaries({"type": st.just("message"), "role": st.sampled_from(["user", "assistant", "developer"]),
                           "content": TEXT | st.lists(INPUT_TEXT, max_size=2)}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": TEXT, "name": NAME, "arguments": TEXT}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": TEXT, "output": TEXT}),
    st.fixed_dictionaries({"type": st.just("reasoning"), "summary": st.lists(
        st.fixed_dictionaries({"type": st.just("summary_text"), "text": TEXT}), max_size=1)}))
RESPONSES_BODY = st.fixed_dictionaries(
    {"input": TEXT | st.tuples(st.fixed_dictionaries({"type": st.just("message"), "role": st.just("user"),
                                                      "content": TEXT}), st.lists(ITEM, max_size=3)).map(
        lambda items: [items[0], *items[1]])},
    optional={"model": st.just("default"), "instructions": TEXT, "max_output_tokens": st.integers(1, 3),
              "temperature": st.floats(0, 2), "stream": st.booleans(),
              "tools": st.lists(st.fixed_dictionaries(
                  {"type": st.just("function"), "name": NAME, "parameters": st.just({"type": "object"})}) |
                  st.just({"type": "web_search"}), min_size=1, max_size=2),
              "tool_choice": st.sampled_from(["auto", "none"]), "parallel_tool_calls": st.booleans(),
              "text": st.fixed_dictionaries({"format": st.fixed_dictionaries({"type": st.sampled_from(
                  ["text", "json_object"])})}),
              "reasoning": st.fixed_dictionaries({"effort": st.sampled_from(["low", "high"])})})
ROUTES = {"/v1/messages": MESSAGES_BODY, "/v1/messages/count_tokens": MESSAGES_BODY, "/v1/responses": RESPONSES_BODY}


def _places(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into a JSON value, the root's children first."""
    if isinstance(value, dict):
        children = value.items()
    elif isinstance(value, list):
        children = enumerate(value)
    else:
        return []
    return [place for key, child in children for place in [(*path, key), *_places(child, (*path, key))]]


@st.composite
def agent_bodies(draw: st.DrawFn) -> tuple[str, Any]:
    """A route and a well-formed body with, mostly, one mutation anywhere in it: a field removed, or its value
    replaced by anything at all (a wrong type, a huge number, odd text). Every inner block is reached."""
    path = draw(st.sampled_from(sorted(ROUTES)))
    body = copy.deepcopy(draw(ROUTES[path]))  # mutated below: never the strategies' own objects (st.just's)
    if path.endswith("count_tokens"):
        body.pop("max_tokens", None)
    places = _places(body)
    for _ in range(draw(st.sampled_from([0, 1, 1, 1, 2]))):
        *parents, last = draw(st.sampled_from(places))
        holder = body
        for key in parents:
            holder = holder[key]
        if isinstance(holder, dict) and draw(st.booleans()):
            del holder[last]
        else:
            holder[last] = draw(WILD)
        places = _places(body)
        if not places:
            break
    return path, body


def _answered_cleanly(path: str, response: httpx.Response) -> None:
    if 400 <= response.status_code < 500:
        (_anthropic_error if path.startswith("/v1/messages") else _openai_error)(response)
        return
    assert response.status_code == 200, (response.status_code, response.text[:500])
    if response.headers["content-type"].startswith("text/event-stream"):
        payloads = [json.loads(line[6:]) for line in response.text.split("\n") if line.startswith("data: ")]
        assert payloads and all(isinstance(p, dict) for p in payloads)
        assert payloads[-1]["type"] in ("message_stop", "response.completed", "response.incomplete", "error"), \
            payloads[-1]
    else:
        assert isinstance(response.json(), dict)


def test_any_agent_body_gets_a_clean_answer_and_the_server_survives(client: httpx.Client) -> None:
    @settings(max_examples=250, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(agent_bodies())
    def answered(request: tuple[str, Any]) -> None:
        path, body = request
        raw = json.dumps(body, ensure_ascii=True).encode()
        _answered_cleanly(path, client.post(path, content=raw, headers={"Content-Type": "application/json"}))

    answered()
    assert client.get("/health").status_code == 200
