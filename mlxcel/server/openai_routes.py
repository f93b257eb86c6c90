"""OpenAI-compatible generation: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

import trio
from pydantic import ValidationError
from quart import Quart, Response, request

from ..engine import EngineUnavailable, Finish, GenerationRequest, QueueFull, SamplingParams, TextDelta
from .context import ServerContext
from .errors import ApiError, bad_request
from .schemas import ChatCompletionRequest, CompletionRequest, describe, unsupported


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event carrying *payload* (JSON, or a literal like ``[DONE]``)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


async def _json_body() -> dict[str, Any]:
    raw = await request.get_data(as_text=False)
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    return body


def _finish_error(finish: Finish) -> ApiError:
    return ApiError(500, finish.error or "generation failed", type="server_error", code="generation_failed")


class _Generation:
    """One request through the engine: validation, submission, and the two response shapes."""

    def __init__(self, ctx: ServerContext, chat: bool) -> None:
        self.ctx = ctx
        self.started = time.perf_counter()
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    async def respond(self) -> Response | dict[str, Any]:
        body = await _json_body()
        schema = ChatCompletionRequest if self.chat else CompletionRequest
        try:
            params = schema.model_validate(body)
        except ValidationError as exc:
            message, param = describe(exc)
            raise bad_request(message, param=param) from exc
        name = unsupported(body)
        if name is not None:
            raise bad_request(f"the parameter {name!r} is not supported by this server", param=name,
                              code="unsupported_parameter")
        options = self.ctx.options
        if params.model is not None and params.model not in (options.model_name, "default"):
            raise ApiError(404, f"the model {params.model!r} does not exist; this server serves "
                                f"{options.model_name!r}", param="model", code="model_not_found")
        engine = self.ctx.engine
        if not engine.ready.is_set():
            raise ApiError(503, "the model is still loading", type="server_error", code="model_loading")
        tokens = await self._prompt_tokens(params)
        requested = (params.max_completion_tokens or params.max_tokens if isinstance(params, ChatCompletionRequest)
                     else params.max_tokens)
        room = options.context_length - len(tokens)
        if room <= 0 or (requested is not None and requested > room):
            raise bad_request(
                f"this model's maximum context length is {options.context_length} tokens, but the request "
                f"needs {len(tokens)} for the prompt and {requested or 1} for the completion",
                param="messages" if self.chat else "prompt", code="context_length_exceeded")
        self.logprobs = (params.logprobs is True) if self.chat else params.logprobs is not None
        generation = GenerationRequest(
            id=self.id, prompt_tokens=tuple(tokens),
            max_tokens=requested or min(options.default_max_tokens, room),
            sampling=SamplingParams(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                    seed=params.seed),
            stop=params.stop_strings(), logprobs=self.logprobs)
        try:
            events = engine.submit(generation)
        except QueueFull as exc:
            raise ApiError(503, f"the server is at capacity ({exc}); retry later", type="server_error",
                           code="queue_full") from exc
        except EngineUnavailable as exc:
            raise ApiError(503, str(exc), type="server_error", code="unavailable") from exc
        if params.stream:
            response = Response(self._stream(events, params.include_usage()), content_type="text/event-stream")
            response.headers["Cache-Control"] = "no-cache"
            response.timeout = None
            return response
        return await self._complete(events)

    async def _prompt_tokens(self, params: CompletionRequest | ChatCompletionRequest) -> list[int]:
        tokenizer = self.ctx.engine.tokenizer
        if isinstance(params, ChatCompletionRequest):
            messages = [{"role": m.role, "content": m.text()} for m in params.messages]
            if getattr(tokenizer, "chat_template", None) is None:
                raise bad_request("this model has no chat template; use /v1/completions", param="messages")

            def render() -> list[int]:
                return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))

            try:
                return await trio.to_thread.run_sync(render)
            except Exception as exc:  # a template that rejects these messages
                raise bad_request(f"the chat template cannot render these messages: {exc}",
                                  param="messages") from exc
        prompt: str | list[int] | list[str] = params.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise bad_request("only one prompt per request is supported", param="prompt",
                                  code="unsupported_parameter")
            prompt = str(prompt[0])
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("the prompt is empty", param="prompt")
            return list(await trio.to_thread.run_sync(tokenizer.encode, prompt))
        vocab = len(tokenizer)
        if not prompt or any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
            raise bad_request(f"prompt token ids must be a non-empty list of integers below {vocab}",
                              param="prompt")
        return list(prompt)  # type: ignore[arg-type]

    # -- shapes ------------------------------------------------------------------

    def _choice(self, text: str, finish_reason: str | None, logprobs: Any, delta: bool) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        content: dict[str, Any] = {"role": "assistant", "content": text}
        return {"index": 0, ("delta" if delta else "message"): content, "logprobs": logprobs,
                "finish_reason": finish_reason}

    def _logprobs(self, deltas: list[TextDelta]) -> Any:
        if not self.logprobs:
            return None
        tokenizer = self.ctx.engine.tokenizer
        ids = [t for d in deltas for t in d.token_ids]
        values = [v for d in deltas for v in (d.logprobs or ())]
        pieces = [tokenizer.decode([t]) for t in ids]
        if self.chat:
            return {"content": [{"token": p, "logprob": v, "bytes": list(p.encode()), "top_logprobs": []}
                                for p, v in zip(pieces, values, strict=True)]}
        return {"tokens": pieces, "token_logprobs": values, "top_logprobs": None, "text_offset": None}

    def _usage(self, finish: Finish) -> dict[str, Any]:
        return {"prompt_tokens": finish.prompt_tokens, "completion_tokens": finish.completion_tokens,
                "total_tokens": finish.prompt_tokens + finish.completion_tokens}

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.ctx.options.model_name,
                "choices": choices}

    @staticmethod
    def _reason(finish: Finish) -> str:
        return "length" if finish.reason == "length" else "stop"

    async def _complete(self, events: trio.MemoryReceiveChannel[Any]) -> dict[str, Any]:
        deltas: list[TextDelta] = []
        finish: Finish | None = None
        try:
            async with events:
                async for event in events:
                    if isinstance(event, TextDelta):
                        deltas.append(event)
                    else:
                        finish = event
        finally:
            self.ctx.observability.request_seconds.observe(time.perf_counter() - self.started)
            if finish is None:  # the client went away (or the server is stopping)
                self.ctx.engine.cancel(self.id)
        if finish is None or finish.reason in ("error", "cancelled"):
            raise _finish_error(finish or Finish("error", 0, 0, error="generation ended early"))
        text = "".join(d.text for d in deltas)
        body = self._envelope(self.object, [self._choice(text, self._reason(finish), self._logprobs(deltas),
                                                         delta=False)])
        body["usage"] = self._usage(finish)
        body["timings"] = asdict(finish.timings)
        return body

    async def _stream(self, events: trio.MemoryReceiveChannel[Any], include_usage: bool) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        finish: Finish | None = None
        try:
            async with events:
                if self.chat:
                    first = self._envelope(obj, [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}])
                    yield sse(first)
                async for event in events:
                    if isinstance(event, TextDelta):
                        choice = self._choice(event.text, None, self._logprobs([event]), delta=True)
                        if self.chat:
                            del choice["delta"]["role"]
                        yield sse(self._envelope(obj, [choice]))
                        continue
                    finish = event
            if finish is None or finish.reason in ("error", "cancelled"):
                error = _finish_error(finish) if finish else ApiError(503, "generation ended early",
                                                                       type="server_error")
                yield sse(error.body())
                yield sse("[DONE]")
                return
            last = self._choice("", self._reason(finish), None, delta=True)
            if self.chat:
                last["delta"] = {}
            chunk = self._envelope(obj, [last])
            chunk["timings"] = asdict(finish.timings)
            yield sse(chunk)
            if include_usage:
                usage = self._envelope(obj, [])
                usage["usage"] = self._usage(finish)
                yield sse(usage)
            yield sse("[DONE]")
        finally:
            self.ctx.observability.request_seconds.observe(time.perf_counter() - self.started)
            if finish is None:  # cancelled mid-stream: the client disconnected
                self.ctx.engine.cancel(self.id)


def register(app: Quart, ctx: ServerContext) -> None:
    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": ctx.options.model_name, "object": "model", "created": 0,
                                            "owned_by": "mlxcel"}]}

    @app.post("/v1/completions")
    async def completions() -> Any:
        return await _Generation(ctx, chat=False).respond()

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Any:
        return await _Generation(ctx, chat=True).respond()
