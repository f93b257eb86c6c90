"""What a chat template may be made to walk is bounded before it renders: messages, content parts, input items,
and the values of ``chat_template_kwargs``; each past its bound is a 400 that names it, on every chat route.

The report's bodies, each within the 4 MB body bound: 120k empty chat messages, 100k Messages turns, 100k
Responses items (1.8-3.0 s of render each), 350k empty objects in Llama 3.1's ``custom_tools`` (4.4-5.2 s).
One server for the module; the bounds themselves are exercised, not only the report's sizes.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from mlxcel.server.bounds import MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_TEMPLATE_KWARG_VALUES


@pytest.fixture
def client(hello_client: httpx.Client) -> httpx.Client:
    return hello_client


def _post(client: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    return client.post(path, content=json.dumps(body, separators=(",", ":")).encode(),
                       headers={"Content-Type": "application/json"})


def _message(response: httpx.Response) -> str:
    assert response.status_code == 400, (response.status_code, response.text[:300])
    return str(response.json()["error"]["message"])


def test_the_reported_bodies_are_400s_that_name_their_bound(client: httpx.Client) -> None:
    empty = {"role": "user", "content": ""}
    chat = _post(client, "/v1/chat/completions", {"messages": [empty] * 120_000, "max_tokens": 1})
    assert f"at most {MAX_MESSAGES} items" in _message(chat)
    turns = _post(client, "/v1/messages", {"model": "default", "max_tokens": 1, "messages": [empty] * 100_000})
    assert f"at most {MAX_MESSAGES} items" in _message(turns)
    items = _post(client, "/v1/responses", {"input": [{"role": "user", "content": ""}] * 100_000})
    assert f"at most {MAX_MESSAGES} items" in _message(items)
    tools = _post(client, "/v1/chat/completions", {"messages": [empty], "max_tokens": 1,
                                                   "chat_template_kwargs": {"custom_tools": [{}] * 350_000}})
    assert f"more than {MAX_TEMPLATE_KWARG_VALUES} values" in _message(tools)


def test_each_bound_holds_at_its_value_and_refuses_past_it(client: httpx.Client) -> None:
    turn = {"role": "user", "content": "x"}
    at_bound = _post(client, "/v1/chat/completions", {"messages": [turn] * MAX_MESSAGES, "max_tokens": 1})
    assert at_bound.status_code == 200 or at_bound.json()["error"]["code"] == "context_length_exceeded", \
        at_bound.text[:300]
    part = {"type": "text", "text": ""}
    parts = {"role": "user", "content": [part] * (MAX_CONTENT_PARTS // 2 + 1)}
    assert "content parts" in _message(_post(client, "/v1/chat/completions", {"messages": [parts, parts],
                                                                              "max_tokens": 1}))
    assert "content blocks" in _message(_post(client, "/v1/messages", {
        "model": "default", "max_tokens": 1, "messages": [parts, parts]}))
    assert "content parts" in _message(_post(client, "/v1/responses", {"input": [
        {**parts, "content": [{"type": "input_text", "text": ""}] * (MAX_CONTENT_PARTS // 2 + 1)}] * 2}))
    values = {"custom_tools": [{"name": "f"}] * (MAX_TEMPLATE_KWARG_VALUES // 2 - 1)}  # one list, its objects
    fine = _post(client, "/v1/chat/completions", {"messages": [turn], "max_tokens": 1,
                                                  "chat_template_kwargs": values})
    assert fine.status_code == 200, fine.text[:300]
    assert client.get("/health").status_code == 200
