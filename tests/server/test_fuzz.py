"""Hypothesis-generated request bodies against one live server: every answer is 2xx or a clean 4xx.

One server per test (not per example), driven from this thread with a
synchronous client while trio runs the server in another. Bodies cover every
parameter of both generation routes with right and wrong types, huge numbers,
odd unicode (lone surrogates included), arbitrary JSON and raw bytes; streamed
and not. ``max_tokens`` is nearly always small so that generation stays fast,
but huge and wrong values are drawn too. After all of it, ``/health`` is 200.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxcel.testing.base import VOCAB_SIZE
from tests.server.conftest import running_server


@contextmanager
def server_in_thread(argv: list[str]) -> Iterator[str]:
    """`mlxcel serve` under its own trio.run in a thread; yields its URL, stops it on exit."""
    started: queue.Queue[str | BaseException] = queue.Queue()
    stop = threading.Event()

    async def serve() -> None:
        async with running_server(argv) as url:
            started.put(url)
            await trio.to_thread.run_sync(stop.wait)

    def run() -> None:
        try:
            trio.run(serve)
        except BaseException as exc:  # reported to the test, which fails with it
            started.put(exc)

    thread = threading.Thread(target=run, name="fuzzed-server", daemon=True)
    thread.start()
    first = started.get(timeout=120)
    if isinstance(first, BaseException):
        raise first
    try:
        yield first
    finally:
        stop.set()
        thread.join(60)
    if not started.empty():
        raise started.get()  # the server failed while serving


ODD_TEXT = st.text(st.characters(codec=None), max_size=40) | st.sampled_from([
    "", " ", "\x00", "\ud800", "a\udfffb", "\u202e", "\ufeff", "😀" * 20, "<|im_start|>", "<|endoftext|>",
    "\r\n" * 10, "e\u0301" * 10, "\U0010ffff"])
HUGE = st.sampled_from([2**63, -(2**63) - 1, 2**64, 10**30, -(10**30), 1e308, -1e308, 5e-324, 1e-300])
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | ODD_TEXT,
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ODD_TEXT, inner, max_size=4),
                    max_leaves=12)


WILD = st.one_of(HUGE, JSON, ODD_TEXT, st.integers(), st.floats())
"""What any parameter may be instead of a value of its type."""
SMALL_TOKENS = st.integers(1, 4)
PROMPT = st.one_of(ODD_TEXT.filter(bool), st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=20),
                   st.lists(ODD_TEXT, min_size=1, max_size=1), st.just("def f(x):" * 400))
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])},
    optional={"content": ODD_TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": ODD_TEXT}),
                                             max_size=3), "name": ODD_TEXT})
#: Each parameter with a value of its type (mostly inside mlxcel's bounds, sometimes just outside).
TYPICAL: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["llama-tiny", "default", "gpt-4o", ""]),
    "max_tokens": SMALL_TOKENS,
    "stream": st.booleans(),
    "temperature": st.floats(0, 2) | st.sampled_from([0, 1e-6, 1e-5, 2.0000001, -0.0]),
    "top_p": st.floats(0, 1) | st.sampled_from([1e-300, 1]),
    "top_k": st.integers(0, 2 * VOCAB_SIZE) | st.sampled_from([VOCAB_SIZE - 1, VOCAB_SIZE, 2**70]),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": ODD_TEXT | st.lists(ODD_TEXT, max_size=34),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "user": ODD_TEXT,
    # Parameters mlxcel cannot honour: their harmless values, or not.
    "n": st.just(1) | st.integers(0, 3),
    "best_of": st.just(1) | st.integers(0, 3),
    "echo": st.just(False) | st.booleans(),
    "suffix": st.just("") | ODD_TEXT,
    "logit_bias": st.just({}) | st.dictionaries(st.integers(0, 600).map(str), st.integers(-100, 100), max_size=3),
    "presence_penalty": st.sampled_from([0, 0.0]) | st.floats(-2, 2),
    "frequency_penalty": st.sampled_from([0, 0.0]) | st.floats(-2, 2),
    "top_logprobs": st.just(0) | st.integers(0, 5),
    "response_format": st.sampled_from([{"type": "text"}, {"type": "json_object"}]),
    "tools": st.just([]),
}
COMPLETION = {**TYPICAL, "prompt": PROMPT, "logprobs": st.integers(0, 6)}
CHAT = {**TYPICAL, "messages": st.lists(MESSAGE, min_size=1, max_size=3), "logprobs": st.booleans(),
        "max_completion_tokens": SMALL_TOKENS}
REQUIRED = {"/v1/completions": ("prompt", "max_tokens", "stream"),
            "/v1/chat/completions": ("messages", "max_tokens", "stream")}


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    """A route and the raw body sent to it: mostly well-formed with at most one wild field."""
    path = draw(st.sampled_from(sorted(REQUIRED)))
    table = CHAT if path == "/v1/chat/completions" else COMPLETION
    mode = draw(st.integers(0, 19))
    if mode == 0:  # not JSON, or not an object
        return path, draw(st.binary(max_size=40) | JSON.map(lambda v: json.dumps(v).encode()))
    names = list(REQUIRED[path]) + draw(st.lists(st.sampled_from(sorted(table)), max_size=5, unique=True))
    names = list(dict.fromkeys(names))
    if mode == 1:  # a required field missing
        names.remove(draw(st.sampled_from(REQUIRED[path])))
    wild = set(names) if mode == 2 else {draw(st.sampled_from(names))} if mode < 8 else set()
    body = {name: draw(WILD if name in wild else table[name]) for name in names}
    return path, json.dumps(body, ensure_ascii=True).encode()


def _check_error(body: Any) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] in ("invalid_request_error", "server_error", "authentication_error")


def _check(response: httpx.Response) -> None:
    status = response.status_code
    assert 200 <= status < 300 or 400 <= status < 500, (status, response.text[:500])
    if status >= 400:
        _check_error(response.json())
        return
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.split("\n") if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", response.text[-500:]
        for event in events[:-1]:
            payload = json.loads(event)
            if "error" in payload:
                _check_error(payload)
            else:
                assert payload["object"] in ("text_completion", "chat.completion.chunk"), payload
        return
    body = response.json()
    assert body["choices"] and body["usage"]["completion_tokens"] >= 0, body


def test_any_request_body_gets_a_clean_answer_and_the_server_survives(llama: Path) -> None:
    with server_in_thread(["--model", str(llama), "--parallel", "4"]) as url, \
            httpx.Client(base_url=url, timeout=60) as client:
        @settings(max_examples=200, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(bodies())
        def answered_cleanly(request: tuple[str, bytes]) -> None:
            path, raw = request
            _check(client.post(path, content=raw, headers={"Content-Type": "application/json"}))

        answered_cleanly()
        assert client.get("/health").status_code == 200
        after = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert after.status_code == 200, after.text
