"""The fleet front's raw ASGI pieces: a stream begun while a model loads, and its errors (no server, no model)."""

from __future__ import annotations

import json
from typing import Any

import trio

from mlxcel.fleet.asgi import PING_AFTER, PING_EVERY, PingedStream, model_named
from mlxcel.http.errors import ApiError


async def test_keep_alives_begin_after_a_second_then_come_every_five(autojump_clock: trio.abc.Clock) -> None:
    sent: list[tuple[float, dict[str, Any]]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append((trio.current_time(), message))

    stream = PingedStream(send, anthropic=True)
    with trio.move_on_after(PING_AFTER + 2 * PING_EVERY + 0.5):
        await stream.ping_while_waiting()
    assert [(t, m["type"]) for t, m in sent] == [(1.0, "http.response.start"), (1.0, "http.response.body"),
                                                 (6.0, "http.response.body"), (11.0, "http.response.body")]
    assert sent[1][1]["body"] == b'event: ping\ndata: {"type":"ping"}\n\n'


async def test_an_error_the_app_answers_becomes_the_routes_error_event() -> None:
    for anthropic, expected in ((False, b'data: {"error":{"message":"no","type":"x"}}\n\n'),
                                (True, b'event: error\ndata: {"error":{"message":"no","type":"x"}}\n\n')):
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any], into: list[dict[str, Any]] = sent) -> None:
            into.append(message)

        stream = PingedStream(send, anthropic)
        await stream.send({"type": "http.response.start", "status": 400, "headers": []})
        await stream.send({"type": "http.response.body", "body": b'{"error": {"message": "no", ', "more_body": True})
        await stream.send({"type": "http.response.body", "body": b'"type": "x"}}'})
        assert sent == [{"type": "http.response.body", "body": expected, "more_body": False}]
    sent.clear()
    await PingedStream(send, anthropic=False).fail(ApiError(503, "not now", code="model_unavailable"))
    assert json.loads(sent[0]["body"].removeprefix(b"data: "))["error"]["code"] == "model_unavailable"


async def test_a_streams_own_events_pass_through_and_its_head_is_dropped() -> None:
    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    stream = PingedStream(send, anthropic=False)
    await stream.send({"type": "http.response.start", "status": 200, "headers": []})
    await stream.send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
    assert sent == [{"type": "http.response.body", "body": b"data: [DONE]\n\n"}]


async def test_the_model_and_whether_a_stream_is_read_from_the_body() -> None:
    assert await model_named(b'{"model": "a", "stream": true}') == ("a", True)
    assert await model_named(b'{"model": 3, "stream": "yes"}') == (None, False)
    assert await model_named(b'[1, 2]') == (None, False)
    assert await model_named(b'{"model": "a"') == (None, False)
