"""OpenAI request bodies, validated with pydantic in strict mode, and the bounds mlxcel sets.

Strict: a string where a number belongs is an error, not a guess. Fields mlxcel
does not know are ignored (OpenAI clients send many); fields it knows but
cannot honour (the legacy ``functions``, ...) are rejected by :func:`unsupported`,
so a client never silently gets something else. The bounds are
:mod:`.bounds`'s, documented in ``docs/http-api.md``.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..engine import SamplingParams
from ..engine.requests import GREEDY_BELOW  # below it a temperature decodes greedily, as in vLLM
from .bounds import (
    MAX_CHOICES,
    MAX_JSON_DEPTH,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_TEMPLATE_KWARG_VALUES,
    MAX_TEMPLATE_KWARGS,
    MAX_TOOLS,
    RESERVED_TEMPLATE_KWARGS,
    SEED_RANGE,
    check_parts,
)
from .content_parts import ContentPart, ImageUrlPart, TextPart
from .images import ImageRef


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema response format needs its json_schema")
        return self

    def target_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must match; None for free text."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema":
            assert self.json_schema is not None
            return self.json_schema.json_schema or {"type": "object"}
        return None


def count_values(value: Any, limit: int) -> int:
    """The values in *value* (itself, and every array, object, string and number within), counted up to just
    past *limit*: the walk stops there. Iterative, so depth costs no stack."""
    count, stack = 0, [value]
    while stack and count <= limit:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=SEED_RANGE[0], lt=SEED_RANGE[1])
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    min_p: float = Field(default=0.0, ge=0, le=1)
    logit_bias: dict[str, float] | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: float = Field(default=1.0, gt=0, le=10)
    # mlx-lm's server's names: the penalties look at this many of the last tokens (prompt included). Unset,
    # presence and frequency count every generated token, as OpenAI's do.
    presence_context_size: int | None = Field(default=None, ge=1, le=2**20)
    frequency_context_size: int | None = Field(default=None, ge=1, le=2**20)
    repetition_context_size: int = Field(default=20, ge=1, le=2**20)
    response_format: ResponseFormat | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_bounds(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is None:
            return None
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} entries")
        for key, bias in value.items():
            if not key.isascii() or not key.isdecimal():
                raise ValueError(f"a key must be a token id, not {key[:20]!r}")
            if not -100 <= bias <= 100:
                raise ValueError("a bias is a number from -100 to 100")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_bounds(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def bias_problem(self, vocab_size: int) -> str | None:
        """Why ``logit_bias`` cannot apply to a vocabulary of *vocab_size*, if it cannot."""
        for key in self.logit_bias or {}:
            if int(key) >= vocab_size:
                return f"logit_bias: token id {key} is not below the vocabulary size {vocab_size}"
        return None

    def sampling(self, vocab_size: int, choice: int = 0, grammar: Any = None) -> SamplingParams:
        """The engine's parameters for choice *choice*, brought into the ranges MLX and mlx-lm accept.

        ``top_k`` at or above the vocabulary keeps every token, which is what 0
        (off) means; mlx-lm would raise for it. A seed becomes ``(seed + choice)
        % 2**64``: the choices of one seeded request differ, and are reproducible.
        *grammar*: the compiled llguidance matcher the output must follow, if any (this choice's own).
        """
        temperature = 0.0 if self.temperature < GREEDY_BELOW else self.temperature
        bias = tuple((int(k), float(v)) for k, v in (self.logit_bias or {}).items())
        return SamplingParams(temperature=temperature, top_p=self.top_p,
                              top_k=0 if self.top_k >= vocab_size else self.top_k,
                              seed=None if self.seed is None else (self.seed + choice) % 2**64,
                              min_p=self.min_p, logit_bias=bias, repetition_penalty=self.repetition_penalty,
                              repetition_context_size=self.repetition_context_size,
                              presence_penalty=self.presence_penalty,
                              presence_context_size=self.presence_context_size,
                              frequency_penalty=self.frequency_penalty,
                              frequency_context_size=self.frequency_context_size, grammar=grammar)


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    """How many alternatives per token (besides the chosen one); None: no logprobs."""
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=MAX_CHOICES)
    """Candidates generated (each a sequence of the engine, like a choice of ``n``); the ``n`` most likely
    are returned."""
    suffix: str | None = None
    """The text after the gap (fill-in-the-middle, :mod:`~.fim`); ``prompt`` is the text before it."""

    def candidates(self) -> int:
        """How many sequences the request generates: ``best_of``, or ``n`` without it."""
        return self.best_of or self.n

    def top_logprobs_count(self) -> int:
        return self.logprobs or 0


class CallFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str
    arguments: str
    """JSON text, as OpenAI sends it."""


class MessageToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    id: str
    type: Literal["function"] = "function"
    function: CallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None
    """An assistant's earlier calls."""
    tool_call_id: str | None = None
    """A ``tool`` message: the call it answers."""
    name: str | None = None
    reasoning_content: str | None = None
    """An assistant's earlier reasoning (vLLM's and DeepSeek's name); templates read this name."""
    reasoning: str | None = None
    """The same, under mlx-lm's, Ollama's and OpenRouter's name."""

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))

    def images(self) -> list[ImageUrlPart]:
        return [part for part in self.content if isinstance(part, ImageUrlPart)] \
            if isinstance(self.content, list) else []


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (``enable_thinking``, ...), as vLLM and mlx-lm's server take them."""
    reasoning_effort: str | None = Field(default=None, max_length=32)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs_bounds(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        if len(value) > MAX_TEMPLATE_KWARGS:
            raise ValueError(f"at most {MAX_TEMPLATE_KWARGS} entries")
        for key in value:
            if not key.isidentifier():
                raise ValueError(f"a key must be a template variable's name, not {key[:40]!r}")
            if key in RESERVED_TEMPLATE_KWARGS:
                raise ValueError(f"{key!r} is set by the server, not by the request")
        if count_values(list(value.values()), MAX_TEMPLATE_KWARG_VALUES) > MAX_TEMPLATE_KWARG_VALUES:
            raise ValueError(f"more than {MAX_TEMPLATE_KWARG_VALUES} values in all (every array, object, string "
                             "and number within counts one): the template walks them as it renders")
        return value

    @field_validator("messages")
    @classmethod
    def _parts_bound(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        check_parts(sum(len(m.content) if isinstance(m.content, list) else 0 for m in messages)
                    + sum(len(m.tool_calls or ()) for m in messages), "content parts and tool calls")
        return messages

    def image_refs(self) -> list[ImageRef]:
        """Every image of the conversation, in order, with its place."""
        return [ImageRef(str((part.model_extra or {}).get("where") or f"messages.{i}.content"), part.image_url.url)
                for i, message in enumerate(self.messages) for part in message.images()]

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template is rendered with besides the messages and tools.

        ``reasoning_effort`` is passed as itself (gpt-oss's templates read it) and
        as ``enable_thinking`` (Qwen's, GLM's: ``none`` turns the reasoning off);
        ``chat_template_kwargs`` come last and win. mlx-lm's tokenizer wrapper
        renames ``enable_thinking`` for templates that call it ``thinking``.
        """
        kwargs: dict[str, Any] = {}
        if self.reasoning_effort is not None:
            kwargs = {"reasoning_effort": self.reasoning_effort, "enable_thinking": self.reasoning_effort != "none"}
        return {**kwargs, **(self.chat_template_kwargs or {})}

    def tool_mode(self) -> str:
        """``none``, ``auto``, ``required`` or ``named``; ``none`` when there are no tools (OpenAI's default)."""
        if not self.tools:
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    def top_logprobs_count(self) -> int:
        return self.top_logprobs or 0


#: Parameters mlxcel knows and cannot honour, with the values that are harmless.
_UNSUPPORTED_UNLESS: dict[str, tuple[Any, ...]] = {
    "functions": ([],),
    "function_call": ("none",),
    # Output mlxcel cannot produce, and services it does not run: ignoring them would answer something else.
    "modalities": (["text"],),
    "audio": (),
    "web_search_options": (),
    "moderation": (),
}


def unsupported(body: dict[str, Any]) -> str | None:
    """The first parameter in *body* that mlxcel cannot honour, if any (absent and null are harmless)."""
    for name, harmless in _UNSUPPORTED_UNLESS.items():
        value = body.get(name)
        # `type(v) is type(h)`: True == 1 in Python, but `"n": true` is not harmless.
        if value is not None and not any(type(value) is type(h) and value == h for h in harmless):
            return name
    return None


_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|[a-z-]+\[.*\])$")
"""How pydantic names a union's member in an error's location (``str``, ``list[...]``, ``tagged-union[...]``):
left out of the message, which names the field, not the type tried."""


def describe(error: ValidationError) -> tuple[str, str | None]:
    """One sentence for the problem, and the parameter it is about.

    Of a union's failures, the deepest, and of those at one depth one that is not a mere type mismatch: a
    content block with a malformed field, or a list past its bound, fails as a string too, and the field or
    the bound is what the client needs to hear of.
    """
    chosen = max(error.errors(), key=lambda e: (len(e["loc"]), not e["type"].endswith("_type")))
    parts = [str(part) for part in chosen["loc"]]
    location = ".".join(part for part in parts if not _UNION_MEMBER.match(part))
    param = parts[0] if parts else None
    return f"{location}: {chosen['msg']}" if location else chosen["msg"], param


def json_problem(body: Any) -> str | None:
    """Why a parsed body cannot be served although it is JSON, if it cannot.

    Nesting deeper than :data:`MAX_JSON_DEPTH` (anywhere, unknown fields
    included: nothing downstream should recurse into it) and strings with a
    lone UTF-16 surrogate (``"\\ud800"`` is valid JSON, but no UTF-8 text, so no
    tokenizer can take it). The walk is iterative, so depth costs no stack.
    """
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode()
                except UnicodeEncodeError:
                    return "the request contains a lone UTF-16 surrogate, which is not text"
        elif isinstance(value, dict | list):
            if depth > MAX_JSON_DEPTH:
                return f"the request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels"
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    stack.append((key, depth))
                stack.append((item, depth + 1))
    return None
