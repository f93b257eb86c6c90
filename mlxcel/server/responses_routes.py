"""OpenAI's Responses API: ``POST /v1/responses`` (Codex's), stateless.

Served as the chat completion it means (:func:`~.responses_schemas.to_chat`),
through the same :class:`~.openai_routes.Generation` as the other routes; only
the shapes are the Responses API's: the Response object with ``message`` and
``function_call`` output items, and its stream of typed, numbered events.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from quart import Quart, Response

from ..engine import Finish
from ..http.errors import ApiError, bad_request
from .choice_reader import ChoiceReader, read_whole
from .context import ServerContext, no_such_model, serves
from .openai_routes import Events, Generation
from .responses_schemas import ResponsesRequest, to_chat
from .schemas import describe
from .wire import event_stream, json_body, off_the_loop_if_large, sse


def _usage(finish: Finish, reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": finish.prompt_tokens,
            "input_tokens_details": {"cached_tokens": finish.timings.cached_n},
            "output_tokens": finish.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": finish.prompt_tokens + finish.completion_tokens}


def _reasoning(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    """A ``reasoning`` item: the model's own reasoning as ``content`` (no summary is written, none encrypted)."""
    return {"type": "reasoning", "id": item_id, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}


def _message(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _function_call(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": status}


class _Responses:
    """One Responses request: validated, served as a chat completion, shaped as the Responses API's."""

    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.generation = Generation(ctx, chat=True)
        self.params: ResponsesRequest | None = None
        self.sequence = 0

    async def respond(self) -> Response | dict[str, Any]:
        body = await json_body(self.ctx.engine)
        try:
            params = await off_the_loop_if_large(ResponsesRequest.model_validate, body)
        except ValidationError as exc:
            message, param = describe(exc)
            raise bad_request(message, param=param) from exc
        if params.model is not None and not serves(self.ctx.options, params.model):
            raise ApiError(404, no_such_model(self.ctx.options, params.model), param="model", code="model_not_found")
        self.params = params
        _, events, _ = await self.generation.start(await off_the_loop_if_large(to_chat, params))
        return event_stream(self._stream(events)) if params.stream else await self._complete(events)

    def _response(self, status: str, output: list[dict[str, Any]], finish: Finish | None = None,
                  error: dict[str, Any] | None = None, reasoning_tokens: int = 0) -> dict[str, Any]:
        params = self.params
        assert params is not None
        incomplete = status == "incomplete"
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.ctx.options.model_name, "output": output, "output_text": "".join(
                    part["text"] for item in output if item["type"] == "message" for part in item["content"]),
                "usage": _usage(finish, reasoning_tokens) if finish is not None else None, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                "instructions": params.instructions,
                "tools": [tool.model_dump(exclude_unset=True) for tool in params.tools or []],
                "tool_choice": params.tool_choice or "auto",
                "parallel_tool_calls": params.parallel_tool_calls is not False, "temperature": params.temperature,
                "top_p": params.top_p, "max_output_tokens": params.max_output_tokens,
                "previous_response_id": None, "store": False, "metadata": {}, "truncation": "disabled",
                "text": {"format": {"type": "text"}},
                "reasoning": {"effort": params.reasoning.effort if params.reasoning else None, "summary": None}}

    def _stopping(self) -> bool:
        return self.ctx.observability.state == "stopping"

    async def _complete(self, events: Events) -> dict[str, Any]:
        answer = await read_whole(events, self.generation.tools, self.generation.thinking, self._stopping())
        text, calls, finish = answer.text, answer.calls, answer.finish
        output = ([_reasoning("rs_" + uuid.uuid4().hex, answer.reasoning)] if answer.reasoning else []) + \
            ([_message("msg_" + uuid.uuid4().hex, text)] if text or not calls else []) + \
            [_function_call(call) for call in calls]
        return self._response("incomplete" if finish.reason == "length" and not calls else "completed",
                              output, finish, reasoning_tokens=answer.reasoning_tokens)

    def _event(self, kind: str, payload: dict[str, Any]) -> bytes:
        self.sequence += 1
        return f"event: {kind}\n".encode() + sse({"type": kind, "sequence_number": self.sequence - 1, **payload})

    async def _stream(self, events: Events) -> AsyncIterator[bytes]:
        yield self._event("response.created", {"response": self._response("in_progress", [])})
        yield self._event("response.in_progress", {"response": self._response("in_progress", [])})
        items, choice = _Items(self._event), ChoiceReader(self.generation.tools, self.generation.thinking)
        async with events:
            async for _, event in events:
                reasoning, text, calls = choice.read(event)
                for piece in items.reasoning(reasoning) + items.text(text) + items.calls(calls):
                    yield piece
        error = choice.failure(self._stopping())
        if error is not None:
            failed = self._response("failed", items.output, error={"code": error.code, "message": error.message})
            yield self._event("response.failed", {"response": failed})
            return
        if not any(item["type"] != "reasoning" for item in items.output) and (
                items.open is None or items.open["type"] == "reasoning"):
            for piece in items.text("", force=True):
                yield piece
        for piece in items.close():
            yield piece
        finish = choice.finish
        assert finish is not None
        status = "incomplete" if finish.reason == "length" and not choice.calls else "completed"
        yield self._event(f"response.{status}", {"response": self._response(
            status, items.output, finish, reasoning_tokens=choice.reasoning_tokens)})


class _Items:
    """The output items of a streamed response, opened and closed as text and tool calls come."""

    def __init__(self, event: Any) -> None:
        self.event = event
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.text_so_far = ""

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    def close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.output)}
        pieces = []
        if item["type"] == "message":
            part = {"type": "output_text", "text": self.text_so_far, "annotations": []}
            item = _message(item["id"], self.text_so_far)
            pieces += [self.event("response.output_text.done", {**where, "content_index": 0,
                                                                "text": self.text_so_far}),
                       self.event("response.content_part.done", {**where, "content_index": 0, "part": part})]
        elif item["type"] == "reasoning":
            item = _reasoning(item["id"], self.text_so_far)
            pieces.append(self.event("response.reasoning_text.done", {**where, "content_index": 0,
                                                                      "text": self.text_so_far}))
        else:
            item = {**item, "status": "completed"}
            pieces.append(self.event("response.function_call_arguments.done", {**where,
                                                                               "arguments": item["arguments"]}))
        pieces.append(self.event("response.output_item.done", {"output_index": len(self.output), "item": item}))
        self.output.append(item)
        return pieces

    def text(self, text: str, force: bool = False) -> list[bytes]:
        if not text and not force:
            return []
        pieces: list[bytes] = []
        if self.open is None or self.open["type"] != "message":
            pieces = self.close()
            self.open, self.text_so_far = _message("msg_" + uuid.uuid4().hex, "", "in_progress"), ""
            pieces += [self.event("response.output_item.added", {"output_index": len(self.output),
                                                                 "item": self.open}),
                       self.event("response.content_part.added", {**self._where(), "content_index": 0, "part": {
                           "type": "output_text", "text": "", "annotations": []}})]
        if text:
            self.text_so_far += text
            pieces.append(self.event("response.output_text.delta", {**self._where(), "content_index": 0,
                                                                    "delta": text, "logprobs": []}))
        return pieces

    def reasoning(self, text: str) -> list[bytes]:
        if not text:
            return []
        pieces: list[bytes] = []
        if self.open is None or self.open["type"] != "reasoning":
            pieces = self.close()
            self.open, self.text_so_far = _reasoning("rs_" + uuid.uuid4().hex, "", "in_progress"), ""
            pieces.append(self.event("response.output_item.added", {"output_index": len(self.output),
                                                                    "item": self.open}))
        self.text_so_far += text
        pieces.append(self.event("response.reasoning_text.delta", {**self._where(), "content_index": 0,
                                                                   "delta": text}))
        return pieces

    def calls(self, deltas: list[dict[str, Any]]) -> list[bytes]:
        """Chat tool-call deltas: one with an ``id`` starts a call, the others carry more of its arguments."""
        pieces: list[bytes] = []
        for delta in deltas:
            arguments = delta.get("function", {}).get("arguments", "")
            if "id" in delta:
                pieces += self.close()
                self.open = _function_call({**delta, "function": {**delta["function"], "arguments": ""}},
                                           "in_progress")
                pieces.append(self.event("response.output_item.added", {"output_index": len(self.output),
                                                                        "item": self.open}))
            if arguments and self.open is not None:
                self.open["arguments"] += arguments
                pieces.append(self.event("response.function_call_arguments.delta", {**self._where(),
                                                                                    "delta": arguments}))
        return pieces


def register(app: Quart, ctx: ServerContext) -> None:
    @app.post("/v1/responses")
    async def responses() -> Any:
        return await _Responses(ctx).respond()

