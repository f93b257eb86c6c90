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

from ..engine import EngineUnavailable, Finish, GenerationRequest, QueueFull, TextDelta
from ..observability import ModelLimits
from .context import ServerContext, at_request_end
from .errors import ApiError, bad_request, finish_error, unavailable
from .schemas import ChatCompletionRequest, CompletionRequest, describe, json_problem, unsupported


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event carrying *payload* (JSON, or a literal like ``[DONE]``)."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


async def _json_body() -> dict[str, Any]:
    raw = await request.get_data(as_text=False)
    try:
        body = json.loads(raw, parse_constant=_no_constants)
    except RecursionError as exc:  # the C parser's own depth guard, at about 1,000 levels
        raise bad_request("the request body nests arrays and objects too deeply", code="invalid_json") from exc
    except ValueError as exc:  # not JSON, not UTF-8, NaN/Infinity, an integer of over 4,300 digits
        raise bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    problem = json_problem(body)
    if problem is not None:
        raise bad_request(problem, code="invalid_json")
    return body


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
        if params.stream_options is not None and not params.stream:
            # As OpenAI and vLLM: options for a stream that is not there are a mistake, not a no-op.
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        options = self.ctx.options
        if params.model is not None and params.model not in (options.model_name, "default"):
            raise ApiError(404, f"the model {params.model!r} does not exist; this server serves "
                                f"{options.model_name!r}", param="model", code="model_not_found")
        limits = self._admit()
        requested = (params.max_completion_tokens or params.max_tokens if isinstance(params, ChatCompletionRequest)
                     else params.max_tokens)
        tokens = await self._prompt_tokens(params, limits, requested or 1)
        room = options.context_length - len(tokens)
        if room <= 0 or (requested is not None and requested > room):
            raise self._too_long(f"{len(tokens)}", requested or 1)
        self.logprobs = (params.logprobs is True) if self.chat else params.logprobs is not None
        generation = GenerationRequest(
            id=self.id, prompt_tokens=tuple(tokens),
            max_tokens=requested or min(options.default_max_tokens, room),
            sampling=params.sampling(limits.vocab_size), stop=params.stop_strings(), logprobs=self.logprobs)
        # A client that left while its prompt was tokenized is noticed here, before anything is submitted.
        await trio.lowlevel.checkpoint()
        engine = self.ctx.engine
        try:
            events = engine.submit(generation)
        except QueueFull as exc:
            raise unavailable(f"the server is at capacity ({exc}); retry later", "queue_full") from exc
        except EngineUnavailable as exc:
            raise unavailable(str(exc), "unavailable") from exc
        # However the request ends, the engine lets it go: even if Quart never starts a stream's
        # body (review D15). No checkpoint since submit, so nothing comes between it and this line.
        def let_go() -> None:
            events.close()
            engine.cancel(generation.id)

        at_request_end(let_go)
        if params.stream:
            response = Response(self._stream(events, params.include_usage()), content_type="text/event-stream")
            response.headers["Cache-Control"] = "no-cache"
            response.timeout = None
            return response
        return await self._complete(events)

    def _admit(self) -> ModelLimits:
        """Readiness and a place, checked before any tokenizing; the place is held until the request ends."""
        limits = self.ctx.observability.limits
        if self._stopping():
            raise unavailable("the server is shutting down", "unavailable")
        if not self.ctx.engine.ready.is_set() or limits is None:
            raise unavailable("the model is still loading", "model_loading")
        admission = self.ctx.admission
        if admission.held >= self.ctx.engine.capacity:
            raise unavailable(f"the server is at capacity (all {self.ctx.engine.capacity} request places "
                               "are taken); retry later", "queue_full")
        admission.held += 1

        def release() -> None:
            admission.held -= 1

        at_request_end(release)
        return limits

    def _too_long(self, prompt: str, completion: int) -> ApiError:
        return bad_request(
            f"this model's maximum context length is {self.ctx.options.context_length} tokens, but the "
            f"request needs {prompt} for the prompt and {completion} for the completion",
            param="messages" if self.chat else "prompt", code="context_length_exceeded")

    async def _encode(self, text: str, completion: int, **kwargs: Any) -> list[int]:
        """*text*'s tokens, refusing it by its length alone when it cannot fit the context."""
        tokenizer, tokens = self.ctx.engine.tokenizer, self.ctx.tokens
        if len(text) > self.ctx.options.context_length:  # each token covers at least one character
            least = await tokens.min_tokens(tokenizer, text)
            if least + completion > self.ctx.options.context_length:
                raise self._too_long(f"at least {least}", completion)
        # The text is UTF-8 without lone surrogates (checked with the body): if the tokenizer still
        # fails, that is the server's fault, a 500.
        return await tokens.encode(tokenizer, text, **kwargs)

    async def _prompt_tokens(self, params: CompletionRequest | ChatCompletionRequest, limits: ModelLimits,
                             completion: int) -> list[int]:
        tokenizer = self.ctx.engine.tokenizer
        if isinstance(params, ChatCompletionRequest):
            messages = [{"role": m.role, "content": m.text()} for m in params.messages]
            if getattr(tokenizer, "chat_template", None) is None:
                raise bad_request("this model has no chat template; use /v1/completions", param="messages")

            def render() -> str:
                return str(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))

            try:
                text = await self.ctx.tokens.run(render)
            except Exception as exc:  # a template that rejects these messages
                raise bad_request(f"the chat template cannot render these messages: {exc}",
                                  param="messages") from exc
            # What apply_chat_template(tokenize=True) does, in two steps so the length bound comes first.
            return await self._encode(text, completion, add_special_tokens=False)
        prompt: str | list[int] | list[str] = params.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise bad_request("only one prompt per request is supported", param="prompt",
                                  code="unsupported_parameter")
            prompt = str(prompt[0])
        if isinstance(prompt, str):
            if not prompt:
                raise bad_request("the prompt is empty", param="prompt")
            return await self._encode(prompt, completion)
        if len(prompt) + completion > self.ctx.options.context_length:  # before looking at every id
            raise self._too_long(f"{len(prompt)}", completion)
        rows = limits.embedding_size
        if not prompt or any(not isinstance(t, int) or not 0 <= t < rows for t in prompt):
            raise bad_request(f"prompt token ids must be a non-empty list of integers from 0 to {rows - 1}",
                              param="prompt")
        return list(prompt)  # type: ignore[arg-type]

    # -- shapes ------------------------------------------------------------------

    def _choice(self, text: str, finish_reason: str | None, logprobs: Any, delta: bool) -> dict[str, Any]:
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        content: dict[str, Any] = {"role": "assistant", "content": text}
        return {"index": 0, ("delta" if delta else "message"): content, "logprobs": logprobs,
                "finish_reason": finish_reason}

    async def _logprobs(self, deltas: list[TextDelta]) -> Any:
        if not self.logprobs:
            return None
        ids = [t for d in deltas for t in d.token_ids]
        values = [v for d in deltas for v in (d.logprobs or ())]
        pieces = await self.ctx.tokens.pieces(self.ctx.engine.tokenizer, ids)
        if self.chat:
            return {"content": [{"token": p, "logprob": v, "bytes": list(p.encode()), "top_logprobs": []}
                                for p, v in zip(pieces, values, strict=True)]}
        return {"tokens": pieces, "token_logprobs": values, "top_logprobs": None, "text_offset": None}

    def _stopping(self) -> bool:
        return self.ctx.observability.state == "stopping"

    def _usage(self, finish: Finish) -> dict[str, Any]:
        return {"prompt_tokens": finish.prompt_tokens, "completion_tokens": finish.completion_tokens,
                "total_tokens": finish.prompt_tokens + finish.completion_tokens}

    def _envelope(self, obj: str, choices: list[dict[str, Any]], usage: bool = False) -> dict[str, Any]:
        """A body or chunk; with *usage* (a stream with include_usage) it says ``"usage": null``, as OpenAI's."""
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.ctx.options.model_name,
                "choices": choices}
        if usage:
            body["usage"] = None
        return body

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
        if finish is None or finish.reason in ("error", "cancelled"):
            raise finish_error(finish, stopping=self._stopping())[0]
        text = "".join(d.text for d in deltas)
        logprobs = await self._logprobs(deltas)
        body = self._envelope(self.object, [self._choice(text, self._reason(finish), logprobs, delta=False)])
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
                                                  "logprobs": None, "finish_reason": None}], include_usage)
                    yield sse(first)
                async for event in events:
                    if isinstance(event, TextDelta):
                        choice = self._choice(event.text, None, await self._logprobs([event]), delta=True)
                        if self.chat:
                            del choice["delta"]["role"]
                        yield sse(self._envelope(obj, [choice], include_usage))
                        continue
                    finish = event
            if finish is None or finish.reason in ("error", "cancelled"):
                error, done = finish_error(finish, stopping=self._stopping())
                yield sse(error.body())
                if done:
                    yield sse("[DONE]")
                return
            last = self._choice("", self._reason(finish), None, delta=True)
            if self.chat:
                last["delta"] = {}
            chunk = self._envelope(obj, [last], include_usage)
            chunk["timings"] = asdict(finish.timings)
            yield sse(chunk)
            if include_usage:
                usage = self._envelope(obj, [])
                usage["usage"] = self._usage(finish)
                yield sse(usage)
            yield sse("[DONE]")
        finally:
            self.ctx.observability.request_seconds.observe(time.perf_counter() - self.started)


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
