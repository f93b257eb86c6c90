"""OpenAI-compatible generation: ``/v1/completions``, ``/v1/chat/completions`` (the model list:
:mod:`.model_routes`)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import asdict
from typing import Any

import trio
from pydantic import ValidationError
from quart import Quart, Response

from ..engine import EngineUnavailable, Event, Finish, GenerationRequest, PromptLogprobs, QueueFull, TextDelta
from ..http.errors import ApiError, bad_request, shutting_down, unavailable
from ..http.scope import at_request_end
from ..observability import ModelLimits
from . import model_routes, shapes, structured
from .choice_reader import ChoiceReader
from .context import ServerContext, no_such_model, serves
from .fanin import fan_in
from .matchers import token_bytes
from .memory import reserve
from .prompts import prompt_tokens, too_long
from .reasoning import Thinking, thinking
from .schemas import ChatCompletionRequest, CompletionRequest, describe, unsupported
from .shapes import ChoiceLog, LogprobShaper
from .tools import ToolSetup
from .wire import event_stream, finish_error, json_body, off_the_loop_if_large, replayed, sse, telling

Events = trio.MemoryReceiveChannel[tuple[int, Event]]
"""A request's events, each with the index of its choice."""


class Generation:
    """One request through the engine: validation, submission, and the two response shapes."""

    def __init__(self, ctx: ServerContext, chat: bool, fit_context: bool = False) -> None:
        self.ctx = ctx
        self.fit_context = fit_context
        """A ``max_tokens`` past the context's room is cut to the room (Anthropic's meaning), not a 400."""
        self.clamped = False
        """It was cut."""
        self.started = time.perf_counter()
        self.chat = chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.shaper: LogprobShaper | None = None
        """Shapes the logprobs, when the request asked for them."""
        self.echo = ""
        """The prompt's text before each choice's (completions ``echo``)."""
        self.tools: ToolSetup | None = None
        """How the output is read for tool calls (None: it is text)."""
        self.thinking: Thinking | None = None
        """How a thinking model's reasoning is told from its answer (None: a chat's output is all answer)."""
        self.prompt: list[int] | None = None
        """The prompt's tokens, when its log-probabilities are asked for (completions ``echo`` with ``logprobs``)."""
        self.prompt_scores: PromptLogprobs | None = None
        """Their log-probabilities, once the engine has sent them (computed once, for the first choice)."""
        self.prompt_length = 0
        """The prompt's tokens, once rendered."""

    async def respond(self) -> Response | dict[str, Any]:
        params, events, candidates = await self.start(await json_body(self.ctx.engine))
        if params.stream:
            return event_stream(self._stream(events, params.n, params.include_usage()))
        return await self._complete(events, candidates, params.n)

    async def start(self, body: dict[str, Any]) -> tuple[ChatCompletionRequest | CompletionRequest, Events, int]:
        """Validate *body*, admit it, render its prompt and submit its choices: (the request, their events,
        how many sequences). The other APIs served as a chat completion start here too."""
        schema: type[ChatCompletionRequest | CompletionRequest] = \
            ChatCompletionRequest if self.chat else CompletionRequest
        try:
            params: ChatCompletionRequest | CompletionRequest = await off_the_loop_if_large(schema.model_validate, body)
        except ValidationError as exc:
            message, param = describe(exc)
            raise bad_request(message, param=param) from exc
        name = unsupported(body)
        best_of = body.get("best_of")
        if name is None and self.chat and best_of is not None and not (type(best_of) is int and best_of == 1):
            name = "best_of"  # a completions parameter (`type(...) is int`: `true` is not 1 here)
        if name is None and self.chat and body.get("echo") not in (None, False):
            name = "echo"  # a completions parameter; a chat echo has no agreed meaning
        if name is None and self.chat and body.get("suffix") not in (None, ""):
            name = "suffix"  # a completions parameter
        if name is None and not self.chat and body.get("top_logprobs") not in (None, 0):
            name = "top_logprobs"  # a chat parameter; completions say `logprobs: N`
        if name is None and not self.chat and body.get("tools") not in (None, []):
            name = "tools"  # a chat parameter
        if name is not None:
            raise bad_request(f"the parameter {name!r} is not supported by this server", param=name,
                              code="unsupported_parameter")
        self._check_combinations(params)
        options = self.ctx.options
        if params.model is not None and not serves(options, params.model):
            raise ApiError(404, no_such_model(options, params.model), param="model", code="model_not_found")
        # best_of candidates are generated, each a sequence; the n most likely are returned.
        candidates = params.candidates() if isinstance(params, CompletionRequest) else params.n
        limits = self._admit(candidates)
        problem = params.bias_problem(limits.vocab_size)
        if problem is not None:
            raise bad_request(problem, param="logit_bias")
        self.tools, matchers = await structured.constraints(params, self.ctx, candidates)
        requested = (params.max_completion_tokens or params.max_tokens if isinstance(params, ChatCompletionRequest)
                     else params.max_tokens)
        # Fitting the context, only the prompt must fit: the completion is cut to the room it leaves.
        least = 1 if self.fit_context else requested or 1
        tokens, checkpoints, images = await prompt_tokens(self.ctx, params, limits, least, self.tools)
        room = options.context_length - len(tokens)
        if self.fit_context and requested is not None and 0 < room < requested:
            requested, self.clamped = room, True
        if room <= 0 or (requested is not None and requested > room):
            raise too_long(self.ctx, self.chat, f"{len(tokens)}", requested or 1)
        logprobs = (params.logprobs is True) if isinstance(params, ChatCompletionRequest) \
            else params.logprobs is not None
        ranked = candidates > params.n  # ranking needs every candidate's log-probabilities
        alternatives = params.top_logprobs_count()
        if logprobs:
            engine = self.ctx.engine
            self.shaper = LogprobShaper(self.ctx.tokens, engine.tokenizer, self.chat, alternatives,
                                        lambda ids: token_bytes(ids, engine))
        if isinstance(params, CompletionRequest) and params.echo:
            self.prompt = tokens if logprobs else None
            self.echo = (params.prompt if isinstance(params.prompt, str) else await self.ctx.tokens.run(
                lambda: str(self.ctx.engine.tokenizer.decode(tokens))))
        generations = [GenerationRequest(
            id=self.id if candidates == 1 else f"{self.id}-{index}", prompt_tokens=tuple(tokens),
            max_tokens=requested or min(options.default_max_tokens, room),
            sampling=params.sampling(limits.vocab_size, index, matchers[index] if matchers else None),
            stop=params.stop_strings(), logprobs=logprobs or ranked,
            top_logprobs=alternatives if logprobs else 0, prompt_logprobs=self.prompt is not None and index == 0,
            group=self.id, checkpoints=checkpoints, images=images)
            for index in range(candidates)]
        self.prompt_length = len(tokens)
        if self.chat and not matchers:  # a grammar decides the output from its first token: no reasoning
            self.thinking = thinking(self.ctx.engine.tokenizer, tokens)
        if self.ctx.ledger is not None:  # under a memory budget: room for the sequences' caches, or a 503
            need = sum(limits.sequence_cost(len(g.prompt_tokens) + g.max_tokens) for g in generations)
            await reserve(self.ctx.ledger, self.id, need, self.ctx.options.model_name or "",
                          self.ctx.options.memory_wait)
        # A client that left while its prompt was tokenized is noticed here, before anything is submitted.
        await trio.lowlevel.checkpoint()
        return params, self._submit(generations), candidates

    def _check_combinations(self, params: CompletionRequest | ChatCompletionRequest) -> None:
        if params.stream_options is not None and not params.stream:
            # As OpenAI and vLLM: options for a stream that is not there are a mistake, not a no-op.
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if isinstance(params, CompletionRequest) and params.best_of is not None:
            if params.best_of < params.n:
                raise bad_request(f"best_of ({params.best_of}) must be at least n ({params.n})", param="best_of")
            if params.best_of > 1 and params.stream:  # as OpenAI: the best is known only at the end
                raise bad_request("best_of cannot be used with stream", param="best_of")
        if isinstance(params, ChatCompletionRequest) and params.top_logprobs and not params.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")

    def _submit(self, generations: list[GenerationRequest]) -> trio.MemoryReceiveChannel[tuple[int, Event]]:
        """Submit every choice at once (so the worker admits them together, into one batch)."""
        engine = self.ctx.engine
        channels: list[trio.MemoryReceiveChannel[Event]] = []
        # However the request ends, the engine lets every choice go: even if Quart never starts a
        # stream's body. No checkpoint from here to the registration.
        def let_go() -> None:
            for channel, generation in zip(channels, generations, strict=False):
                channel.close()
                engine.cancel(generation.id)

        at_request_end(let_go)
        for generation in generations:
            try:
                channels.append(engine.submit(generation))
            except QueueFull as exc:
                raise unavailable(f"the server is at capacity ({exc}); retry later", "queue_full") from exc
            except EngineUnavailable as exc:
                raise unavailable(str(exc), "unavailable") from exc
        return fan_in(channels)

    def _admit(self, places: int) -> ModelLimits:
        """Readiness and *places* (one per choice), checked before any tokenizing; held until the request ends."""
        limits = self.ctx.observability.limits
        if self._stopping():
            raise shutting_down()
        if not self.ctx.engine.ready.is_set() or limits is None:
            raise unavailable("the model is still loading", "model_loading")
        taken, capacity = self.ctx.places, self.ctx.engine.capacity
        if places > capacity:
            raise bad_request(f"n is {places}, but this server holds at most {capacity} sequences at once",
                              param="n")
        if taken.count + places > capacity:
            raise unavailable(f"the server is at capacity (all {capacity} request places "
                               "are taken); retry later", "queue_full")
        taken.count += places

        def release() -> None:
            taken.count -= places

        at_request_end(release)
        return limits

    # -- shapes ------------------------------------------------------------------

    def _stopping(self) -> bool:
        return self.ctx.observability.state == "stopping"

    def _envelope(self, obj: str, choices: list[dict[str, Any]], usage: bool = False) -> dict[str, Any]:
        """A body or chunk; with *usage* (a stream with include_usage) a chat chunk says ``"usage": null``.

        As OpenAI's schemas: a chat chunk's ``usage`` is nullable, a completion's (the legacy
        shape, shared by the body and its chunks) is not, so a completion chunk leaves it out.
        """
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.ctx.options.model_name,
                "choices": choices}
        if usage and self.chat:
            body["usage"] = None
        return body

    async def _logprobs(self, deltas: list[TextDelta], log: ChoiceLog) -> Any:
        return None if self.shaper is None else await self.shaper.shape(deltas, log)

    async def _prompt_logprobs(self, log: ChoiceLog) -> Any:
        """The echoed prompt's logprobs, when they were asked for (they advance *log*'s offset)."""
        if self.shaper is None or self.prompt is None or self.prompt_scores is None:
            return None
        return await self.shaper.shape_prompt(self.prompt, self.prompt_scores, log)

    def _new_logs(self, n: int) -> list[ChoiceLog]:
        # With the prompt's logprobs, the offsets count its token texts from 0.
        return [ChoiceLog(deltas=[], offset=0 if self.prompt is not None else len(self.echo)) for _ in range(n)]

    async def _complete(self, events: trio.MemoryReceiveChannel[tuple[int, Event]], candidates: int,
                        n: int) -> dict[str, Any]:
        """The body of *n* choices: all *candidates*, or (``best_of``) the *n* of them most likely."""
        logs = self._new_logs(candidates)
        try:
            async with events:
                async for index, event in events:
                    if isinstance(event, TextDelta):
                        logs[index].deltas.append(event)
                    elif isinstance(event, PromptLogprobs):
                        self.prompt_scores = event
                    else:
                        logs[index].finish = event
        finally:
            self.ctx.observability.request_seconds.observe(time.perf_counter() - self.started)
        finishes = [log.finish for log in logs]
        failed = [f for f in finishes if f is None or f.reason in ("error", "cancelled")]
        if failed:
            raise finish_error(telling(failed), stopping=self._stopping())[0]
        done = [f for f in finishes if f is not None]
        if candidates > n:  # best_of: the highest cumulative log-probability first
            logs = sorted(logs, key=lambda log: -sum(v for d in log.deltas for v in d.logprobs or ()))[:n]
        choices = []
        for index, log in enumerate(logs):
            text = self.echo + "".join(d.text for d in log.deltas)
            assert log.finish is not None
            reason, calls, reasoning = shapes.reason(log.finish), None, ""
            if self.chat:
                reader = ChoiceReader(self.tools, self.thinking)
                (reasoning, text, _), rest = reader.feed(text), reader.end()
                reasoning, text = reasoning + rest.reasoning, text + rest.text
                if self.tools is not None:
                    calls, reason = reader.calls, shapes.tool_reason(reason, reader.calls)
            logprobs = shapes.joined(await self._prompt_logprobs(log), await self._logprobs(log.deltas, log))
            choices.append(shapes.choice(self.chat, index, text, reason, logprobs, delta=False, tool_calls=calls,
                                         reasoning=reasoning))
        body = self._envelope(self.object, choices)
        body["usage"] = shapes.usage(done)  # every candidate's tokens were generated (OpenAI bills best_of)
        assert logs[0].finish is not None
        body["timings"] = asdict(logs[0].finish.timings)
        return body

    async def _stream(self, events: trio.MemoryReceiveChannel[tuple[int, Event]], n: int,
                      include_usage: bool) -> AsyncIterator[bytes]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        logs = self._new_logs(n)
        readers = [ChoiceReader(self.tools, self.thinking) if self.chat else None for _ in range(n)]
        try:
            async with events:
                held = await self._until_prompt_scored(events)
                for index in range(n):
                    if self.chat or self.echo:  # the role first (chat), or the echoed prompt (completions)
                        prompt_logprobs = await self._prompt_logprobs(logs[index])
                        first = shapes.choice(self.chat, index, self.echo, None, prompt_logprobs, delta=True,
                                              first=True)
                        if self.tools is not None:  # no content yet: it may be tool calls only (as OpenAI)
                            del first["delta"]["content"]
                        yield sse(self._envelope(obj, [first], include_usage))
                # A loop left early (an error) must close the replay: trio finalizes no async generator.
                async with aclosing(replayed(held, events)) as replay:
                    async for index, event in replay:
                        log, reader = logs[index], readers[index]
                        if isinstance(event, TextDelta):
                            reasoning, text, calls = ("", event.text, []) if reader is None \
                                else reader.feed(event.text)
                            logprobs = await self._logprobs([event], log)
                            if reader is None or reader.plain or reasoning or text or logprobs is not None:
                                choice = shapes.choice(self.chat, index, text, None, logprobs, delta=True,
                                                       reasoning=reasoning)
                                yield sse(self._envelope(obj, [choice], include_usage))
                            for call in calls:
                                yield sse(self._envelope(obj, [shapes.tool_delta(index, call)], include_usage))
                            continue
                        if isinstance(event, PromptLogprobs):  # read already
                            continue
                        log.finish = event
                        if event.reason in ("error", "cancelled"):
                            break
                        reason = shapes.reason(event)
                        if reader is not None:
                            reasoning, text, calls = reader.end()
                            if reasoning or text:
                                choice = shapes.choice(self.chat, index, text, None, None, delta=True,
                                                       reasoning=reasoning)
                                yield sse(self._envelope(obj, [choice], include_usage))
                            for call in calls:
                                yield sse(self._envelope(obj, [shapes.tool_delta(index, call)], include_usage))
                            if self.tools is not None:
                                reason = shapes.tool_reason(reason, reader.calls)
                        last = shapes.choice(self.chat, index, "", reason, None, delta=True)
                        if self.chat:
                            last["delta"] = {}
                        chunk = self._envelope(obj, [last], include_usage)
                        chunk["timings"] = asdict(event.timings)
                        yield sse(chunk)
            failed = [log.finish for log in logs if log.finish is None or log.finish.reason in ("error", "cancelled")]
            if failed:
                error, done = finish_error(telling(failed), stopping=self._stopping())
                yield sse(error.body())
                if done:
                    yield sse("[DONE]")
                return
            if include_usage:
                usage = self._envelope(obj, [])
                usage["usage"] = shapes.usage([log.finish for log in logs if log.finish is not None])
                yield sse(usage)
            yield sse("[DONE]")
        finally:
            self.ctx.observability.request_seconds.observe(time.perf_counter() - self.started)

    async def _until_prompt_scored(self, events: trio.MemoryReceiveChannel[tuple[int, Event]]
                                   ) -> list[tuple[int, Event]]:
        """When the prompt's logprobs are asked for, read events until they come (they open the stream), or
        until the first choice ends without them; the events read before them, to be handled after."""
        held: list[tuple[int, Event]] = []
        if self.prompt is None:
            return held
        async for index, event in events:
            held.append((index, event))
            if isinstance(event, PromptLogprobs):
                self.prompt_scores = event
                break
            if index == 0 and isinstance(event, Finish):
                break
        return held


def register(app: Quart, ctx: ServerContext) -> None:
    model_routes.register(app, ctx.options, kind="generation")

    @app.post("/v1/completions")
    async def completions() -> Any:
        return await Generation(ctx, chat=False).respond()

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Any:
        return await Generation(ctx, chat=True).respond()
