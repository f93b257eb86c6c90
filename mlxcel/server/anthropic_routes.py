"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens`` (Claude Code's).

A Messages request is served as the chat completion it means
(:func:`~.anthropic_schemas.to_chat`), through the same :class:`~.openai_routes.Generation`:
its admission, chat template, tool-call parser, grammar, engine (continuous
batching, the prefix cache, the B=1 MTP burst). Only the shapes differ: the
Message object, Anthropic's stream of named events, its stop reasons and usage,
and its error bodies (:func:`mlxcel.http.errors.anthropic_body`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

import trio
from pydantic import ValidationError
from quart import Quart, Response

from ..engine import Finish
from ..http.errors import ApiError, bad_request
from .anthropic_schemas import CountTokensRequest, MessagesRequest, count_body, to_chat
from .choice_reader import ChoiceReader, read_whole
from .context import ServerContext, no_such_model, serves
from .openai_routes import Events, Generation
from .prompts import prompt_tokens
from .schemas import ChatCompletionRequest, describe
from .structured import check_tool_choice
from .tools import ToolSetup
from .wire import event_stream, json_body, off_the_loop_if_large

PING_SECONDS = 5.0
"""While a long prompt prefills, a ``ping`` this often, so that a client's read timeout does not fire."""


def _event(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, separators=(',', ':'))}\n\n".encode()


def _stop_reason(finish: Finish, calls: list[dict[str, Any]], clamped: bool) -> tuple[str, str | None]:
    """(``stop_reason``, ``stop_sequence``) of a finished message; *clamped*: ``max_tokens`` was cut to the
    context's room, so running out of it is running out of context."""
    if calls:
        return "tool_use", None
    if finish.reason == "length":
        return ("model_context_window_exceeded" if clamped else "max_tokens"), None
    if finish.stop_sequence is not None:
        return "stop_sequence", finish.stop_sequence
    return "end_turn", None


def _usage(finish: Finish) -> dict[str, Any]:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens not read from the prefix cache."""
    cached = finish.timings.cached_n
    return {"input_tokens": finish.prompt_tokens - cached, "output_tokens": finish.completion_tokens,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _thinking(reasoning: str) -> dict[str, Any]:
    """A ``thinking`` block; its ``signature`` is empty: nothing here signs, or checks, a model's reasoning."""
    return {"type": "thinking", "thinking": reasoning, "signature": ""}


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call as a ``tool_use`` block (its arguments as an object; unreadable ones as ``{}``)."""
    try:
        arguments = json.loads(call["function"]["arguments"] or "{}")
    except ValueError:
        arguments = {}
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": arguments if isinstance(arguments, dict) else {}}


def _check_model(ctx: ServerContext, model: str) -> None:
    # Claude Code names its own models (claude-*) for its main and background work: all mean this one.
    if not serves(ctx.options, model) and not model.startswith("claude-"):
        raise ApiError(404, no_such_model(ctx.options, model), code="model_not_found")


class _Message:
    """One Messages request: validated, served as a chat completion, shaped as Anthropic's."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.id = "msg_" + uuid.uuid4().hex
        # Claude Code asks for 32,000 tokens whatever the model's context: what does not fit is cut, and a
        # generation that fills the context stops with Anthropic's model_context_window_exceeded.
        self.generation = Generation(ctx, chat=True, fit_context=True)
        self.model = ""
        """The model the request named, echoed back as Anthropic does."""

    async def respond(self) -> Response | dict[str, Any]:
        body = await json_body(self.ctx.engine)
        try:
            params = await off_the_loop_if_large(MessagesRequest.model_validate, body)
        except ValidationError as exc:
            raise bad_request(describe(exc)[0]) from exc
        _check_model(self.ctx, params.model)
        self.model = params.model
        _, events, _ = await self.generation.start(await off_the_loop_if_large(to_chat, params))
        return event_stream(self._stream(events)) if params.stream else await self._complete(events)

    def _envelope(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None],
                  usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    def _stopping(self) -> bool:
        return self.ctx.observability.state == "stopping"

    async def _complete(self, events: Events) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            answer = await read_whole(events, self.generation.tools, self.generation.thinking, self._stopping())
        finally:
            self.ctx.observability.request_seconds.observe(time.perf_counter() - started)
        content = ([_thinking(answer.reasoning)] if answer.reasoning else []) + \
            ([{"type": "text", "text": answer.text}] if answer.text else []) + [_tool_use(c) for c in answer.calls]
        return self._envelope(content, _stop_reason(answer.finish, answer.calls, self.generation.clamped),
                              _usage(answer.finish))

    async def _stream(self, events: Events) -> AsyncIterator[bytes]:
        """Anthropic's events: message_start, then per block content_block_start / _delta / _stop, then
        message_delta (the stop reason and usage) and message_stop; ``ping`` while nothing else comes."""
        started = time.perf_counter()
        usage = {"input_tokens": self.generation.prompt_length, "output_tokens": 0}
        yield _event("message_start", {"message": self._envelope([], (None, None), usage)})
        blocks, choice = _Blocks(), ChoiceReader(self.generation.tools, self.generation.thinking)
        try:
            async with events, aclosing(_with_pings(events)) as stream:
                async for event in stream:
                    if event is None:
                        yield _event("ping", {})
                        continue
                    reasoning, text, calls = choice.read(event)
                    for piece in blocks.thinking(reasoning) + blocks.text(text) + blocks.calls(calls):
                        yield piece
            error = choice.failure(self._stopping())
            if error is not None:
                yield _event("error", {"error": {"type": "api_error" if error.status >= 500 else
                                                 "invalid_request_error", "message": error.message}})
                return
            for piece in blocks.close():
                yield piece
            finish = choice.finish
            assert finish is not None
            reason, sequence = _stop_reason(finish, choice.calls, self.generation.clamped)
            yield _event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                           "usage": _usage(finish)})
            yield _event("message_stop", {})
        finally:
            self.ctx.observability.request_seconds.observe(time.perf_counter() - started)


class _Blocks:
    """The content blocks of a streamed message, opened and closed as text and tool calls come."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None  # "thinking", "text", "tool_use" or None

    def _start(self, block: dict[str, Any]) -> list[bytes]:
        pieces = self.close()
        self.index += 1
        self.open = block["type"]
        return [*pieces, _event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]

    def text(self, text: str) -> list[bytes]:
        if not text:
            return []
        pieces = self._start({"type": "text", "text": ""}) if self.open != "text" else []
        return [*pieces, _event("content_block_delta", {"index": self.index,
                                                        "delta": {"type": "text_delta", "text": text}})]

    def thinking(self, reasoning: str) -> list[bytes]:
        if not reasoning:
            return []
        pieces = self._start(_thinking("")) if self.open != "thinking" else []
        return [*pieces, _event("content_block_delta", {"index": self.index, "delta": {
            "type": "thinking_delta", "thinking": reasoning}})]

    def calls(self, deltas: list[dict[str, Any]]) -> list[bytes]:
        """Chat tool-call deltas: one with an ``id`` starts a call, the others carry more of its arguments."""
        pieces: list[bytes] = []
        for delta in deltas:
            if "id" in delta:
                pieces += self._start({**_tool_use({**delta, "function": {**delta["function"], "arguments": ""}}),
                                       "input": {}})
            arguments = delta.get("function", {}).get("arguments", "")
            if arguments:
                pieces.append(_event("content_block_delta", {"index": self.index, "delta": {
                    "type": "input_json_delta", "partial_json": arguments}}))
        return pieces


async def _with_pings(events: Events) -> AsyncGenerator[Any, None]:
    """*events*' events (without their choice index), and None whenever none came for :data:`PING_SECONDS`."""
    while True:
        received: tuple[int, Any] | None = None
        with trio.move_on_after(PING_SECONDS):  # never yield inside it: the timeout would cover the reader
            try:
                received = await events.receive()
            except trio.EndOfChannel:
                return
        yield None if received is None else received[1]


def register(app: Quart, ctx: ServerContext) -> None:
    @app.post("/v1/messages")
    async def messages() -> Any:
        return await _Message(ctx).respond()

    @app.post("/v1/messages/count_tokens")
    async def count_tokens() -> Any:
        body = await json_body(ctx.engine)
        try:
            params = await off_the_loop_if_large(CountTokensRequest.model_validate, body)
            chat = await off_the_loop_if_large(lambda: ChatCompletionRequest.model_validate(count_body(params)))
        except ValidationError as exc:
            raise bad_request(describe(exc)[0]) from exc
        _check_model(ctx, params.model)
        check_tool_choice(chat)
        limits = ctx.observability.limits
        if limits is None or not ctx.engine.ready.is_set():
            raise ApiError(503, "the model is still loading", type="server_error", code="model_loading")
        # The tools as the template renders them (tool_choice "none" renders none, as /v1/messages does).
        rendered = [tool.model_dump(exclude_none=True) for tool in chat.tools or []]
        tools = ToolSetup("auto", rendered) if rendered and chat.tool_choice != "none" else None
        prompt = await prompt_tokens(ctx, chat, limits, 1, tools, checkpoints=False)
        return {"input_tokens": len(prompt.tokens)}
