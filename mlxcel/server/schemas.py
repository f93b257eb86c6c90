"""OpenAI request bodies, validated with pydantic in strict mode.

Strict: a string where a number belongs is an error, not a guess. Fields mlxcel
does not know are ignored (OpenAI clients send many); fields it knows but
cannot honour (``n > 1``, ``logit_bias``, tools, ...) are rejected by
:func:`unsupported`, so a client never silently gets something else.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_STOP_STRINGS = 16


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        return value

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False


#: Parameters mlxcel knows and cannot honour, with the value that is harmless.
_UNSUPPORTED_UNLESS = {
    "n": 1,
    "best_of": 1,
    "echo": False,
    "suffix": None,
    "logit_bias": None,
    "tools": None,
    "functions": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "top_logprobs": None,
}


def unsupported(body: dict[str, Any]) -> str | None:
    """The first parameter in *body* that mlxcel cannot honour, if any."""
    for name, harmless in _UNSUPPORTED_UNLESS.items():
        value = body.get(name, harmless)
        if value not in (harmless, None) and value != {} and value != []:
            return name
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type", "text") != "text":
        return "response_format"
    return None


def describe(error: ValidationError) -> tuple[str, str | None]:
    """One sentence for the first problem, and the parameter it is about."""
    first = error.errors()[0]
    location = ".".join(str(part) for part in first["loc"])
    param = str(first["loc"][0]) if first["loc"] else None
    return f"{location}: {first['msg']}" if location else first["msg"], param
