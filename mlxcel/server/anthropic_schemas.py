"""Anthropic Messages API request bodies (``POST /v1/messages``), validated, and turned into a chat request.

A Messages request is served as the chat completion it means: the same chat
template, tool-call parser, grammar path and engine as ``/v1/chat/completions``.
:func:`to_chat` does the translation; every field Claude Code sends is accepted,
and those with no meaning here are ignored (``docs/http-api.md`` lists them).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag

from ..http.errors import bad_request
from .bounds import MAX_MESSAGES, MAX_STOP_STRINGS, MAX_TOOLS, check_parts, declared_type
from .images import data_url

BILLING_HEADER = "x-anthropic-billing-header:"
"""Claude Code's first system block starts so, and changes per client: kept, every prompt would miss the prefix
cache, so the block is dropped from what the model sees."""


class _Block(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ImageBlock(_Block):
    """An ``image`` block (served as a chat ``image_url`` part) or a ``document`` block (refused)."""

    type: Literal["image", "document"]
    source: dict[str, Any]


class ThinkingBlock(_Block):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


def _block_tag(known: frozenset[str]) -> Callable[[Any], str | None]:
    """The union member a block validates as: its own type where it is one of *known*, else the open one."""

    def tag(value: Any) -> str | None:
        kind = declared_type(value)
        if kind is None:
            return None  # pydantic's "unable to extract tag" error: a 400 naming the block
        if kind in ("image", "document"):
            return "image"
        return kind if kind in known else "other"

    return tag


ResultPart = Annotated[Annotated[TextBlock, Tag("text")] | Annotated[ImageBlock, Tag("image")]
                       | Annotated[_Block, Tag("other")], Discriminator(_block_tag(frozenset({"text"})))]
"""A part of a ``tool_result``'s content."""


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[ResultPart] = ""
    is_error: bool = False

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content if isinstance(part, TextBlock))


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("text")] | Annotated[ImageBlock, Tag("image")]
    | Annotated[ToolUseBlock, Tag("tool_use")] | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[ThinkingBlock, Tag("thinking")] | Annotated[_Block, Tag("other")],
    Discriminator(_block_tag(frozenset({"text", "tool_use", "tool_result", "thinking"})))]
"""A message's content block: the kinds mlxcel reads are validated whole (a malformed one is a 400 that names
its field); others (``redacted_thinking``, server tool blocks, ...) need only a ``type``."""


class Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]

    def parts(self) -> int:
        """Its blocks, and the parts of its tool results' content."""
        if isinstance(self.content, str):
            return 0
        return len(self.content) + sum(len(block.content) for block in self.content
                                       if isinstance(block, ToolResultBlock) and isinstance(block.content, list))


def _bounded(messages: list[Message]) -> list[Message]:
    check_parts(sum(message.parts() for message in messages), "content blocks")
    return messages


Messages = Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES), AfterValidator(_bounded)]
"""A conversation, bounded in messages and blocks: a template renders each (:data:`~.bounds.MAX_MESSAGES`)."""


class ToolDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})


class ToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: str
    """``disabled`` turns a thinking template's reasoning off; any other (``enabled``, ``adaptive``) on."""
    budget_tokens: int | None = None
    """Ignored: the reasoning ends when the model ends it, within ``max_tokens``."""


class MessagesRequest(BaseModel):
    """The fields mlxcel uses; others (``metadata``, ``context_management``, ``output_config``,
    ``cache_control`` on blocks, ``service_tier``, ...) are accepted and ignored."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str
    max_tokens: int = Field(ge=1)
    messages: Messages
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    temperature: float = Field(default=1.0, ge=0, le=1)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    stream: bool = False
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class CountTokensRequest(BaseModel):
    """``/v1/messages/count_tokens``: a Messages request without ``max_tokens``."""

    model_config = ConfigDict(strict=True, extra="allow")
    model: str
    messages: Messages
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


def _system_text(system: str | list[TextBlock] | None) -> str:
    if system is None:
        return ""
    if isinstance(system, str):
        return system
    return "\n".join(block.text for block in system if not block.text.startswith(BILLING_HEADER))


def _blocks(message: Message, index: int) -> list[_Block]:
    """*message*'s blocks; a ``document`` block anywhere in it (a ``tool_result``'s content too) is a 400."""
    if isinstance(message.content, str):
        return [TextBlock(type="text", text=message.content)]
    for block in message.content:
        parts = block.content if isinstance(block, ToolResultBlock) and isinstance(block.content, list) else [block]
        for part in parts:
            if isinstance(part, ImageBlock) and part.type == "document":
                raise bad_request(f"messages.{index}: document blocks cannot be served", param="messages")
    return list(message.content)


def _system_blocks(message: Message, index: int) -> list[_Block]:
    """A system-role message's blocks: text only (an image there is a 400; a system prompt is text)."""
    blocks = _blocks(message, index)
    if any(isinstance(block, ImageBlock) for block in blocks):
        raise bad_request(f"messages.{index}: a system message holds text only, not images", param="messages")
    return blocks


def _image_part(block: ImageBlock, where: str) -> dict[str, Any]:
    """An ``image`` block as the chat ``image_url`` part :mod:`.images` reads (``base64`` and ``url`` sources)."""
    source = block.source
    if source.get("type") == "base64" and isinstance(source.get("data"), str) \
            and isinstance(source.get("media_type"), str):
        return {"type": "image_url", "image_url": {"url": data_url(source["media_type"], source["data"])}}
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise bad_request(f"{where}: an image's source must be {{type: base64, media_type, data}} or {{type: url, url}}",
                      param="messages", code="invalid_image")


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """A chat message's content from its text and image parts in their order: its text when it holds no image."""
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _result_parts(block: ToolResultBlock, where: str) -> list[dict[str, Any]]:
    """A ``tool_result``'s content as chat parts in order (an error's text after ``Error:``, as before images)."""
    if isinstance(block.content, str) or not any(isinstance(part, ImageBlock) for part in block.content):
        text = block.text()
        return [{"type": "text", "text": f"Error: {text}" if block.is_error else text}]
    # Its texts joined as a result without images joins them (``text()``): a line apart, after "Error: ".
    parts = [{"type": "text", "text": "Error: "}] if block.is_error else []
    wrote_text = False
    for part in block.content:
        if isinstance(part, TextBlock):
            parts.append({"type": "text", "text": "\n" + part.text if wrote_text else part.text})
            wrote_text = True
        elif isinstance(part, ImageBlock):
            parts.append(_image_part(part, where))
    return parts


def _texts(blocks: list[_Block]) -> list[str]:
    return [block.text for block in blocks if isinstance(block, TextBlock)]


def _chat_messages(params: MessagesRequest | CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as chat completion messages: a system message, tool calls and their results."""
    chat: list[dict[str, Any]] = []
    # A system-role message inside `messages` (Claude Code sends one) joins the system prompt: chat
    # templates take one system message, first.
    systems = [_system_text(params.system), *("\n".join(_texts(_system_blocks(m, i)))
                                               for i, m in enumerate(params.messages) if m.role == "system")]
    system = "\n".join(s for s in systems if s)
    if system:
        chat.append({"role": "system", "content": system})
    for index, message in enumerate(params.messages):
        if message.role == "system":
            continue
        parts: list[dict[str, Any]] = []  # text and images, in order
        thoughts: list[str] = []
        calls: list[dict[str, Any]] = []
        for block in _blocks(message, index):
            if isinstance(block, TextBlock):
                parts.append({"type": "text", "text": block.text})
            elif isinstance(block, ImageBlock):
                parts.append(_image_part(block, f"messages.{index}"))
            elif isinstance(block, ToolUseBlock) and message.role == "assistant":
                calls.append({"id": block.id, "type": "function",
                              "function": {"name": block.name, "arguments": json.dumps(block.input)}})
            elif isinstance(block, ToolResultBlock) and message.role == "user":
                chat.append({"role": "tool", "tool_call_id": block.tool_use_id,
                             "content": _content(_result_parts(block, f"messages.{index}"))})
            elif isinstance(block, ThinkingBlock) and message.role == "assistant":
                thoughts.append(block.thinking)
            # redacted_thinking (opaque), server tool blocks: nothing the template renders
        if parts or calls or not isinstance(message.content, list):
            entry: dict[str, Any] = {"role": message.role, "content": _content(parts)}
            if calls:
                entry["tool_calls"] = calls
            if any(thoughts):
                entry["reasoning_content"] = "\n".join(t for t in thoughts if t)
            chat.append(entry)
    if all(entry["role"] == "system" for entry in chat):
        raise bad_request("messages: the conversation has no user or assistant turn to answer", param="messages")
    return chat


def _tool_fields(params: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    """``tools`` and ``tool_choice`` as chat's (a choice that forces a call without tools is chat's 400 too)."""
    fields: dict[str, Any] = {"tools": [{"type": "function", "function": {
        "name": tool.name, "description": tool.description, "parameters": tool.input_schema}}
        for tool in params.tools]} if params.tools else {}
    choice = params.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if choice.name is None:
                raise bad_request("tool_choice of type 'tool' needs the tool's name", param="tool_choice")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    return fields


def _thinking_fields(params: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    if params.thinking is None:
        return {}  # the template's own default
    return {"chat_template_kwargs": {"enable_thinking": params.thinking.type != "disabled"}}


def to_chat(params: MessagesRequest) -> dict[str, Any]:
    """The chat completions body that serves *params* (validated again there, with its bounds)."""
    return {"messages": _chat_messages(params), "max_tokens": params.max_tokens, "temperature": params.temperature,
            "top_p": params.top_p, "top_k": params.top_k, "stop": params.stop_sequences, "stream": params.stream,
            **_tool_fields(params), **_thinking_fields(params)}


def count_body(params: CountTokensRequest) -> dict[str, Any]:
    """The chat body whose prompt :func:`to_chat` would render for the same conversation."""
    return {"messages": _chat_messages(params), "max_tokens": 1, **_tool_fields(params), **_thinking_fields(params)}
