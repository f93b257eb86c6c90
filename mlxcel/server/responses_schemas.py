"""OpenAI Responses API request bodies (``POST /v1/responses``, Codex's), validated, and turned into a chat request.

Stateless, as Codex uses it (``store: false``; it resends the whole history
every turn): the input items become the chat completion they mean, served by
the same chat template, tool-call parser, grammar path and engine as
``/v1/chat/completions``. Fields with no meaning here are accepted and ignored
(``docs/http-api.md`` lists them); ``previous_response_id`` is a 400, since
nothing is stored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag

from ..http.errors import bad_request
from .bounds import MAX_MESSAGES, MAX_TOOLS, check_parts, declared_type


class FunctionTool(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class _Tool(BaseModel):
    """A tool of a kind not served here (``web_search``, ``namespace``, ...): dropped."""

    model_config = ConfigDict(strict=True, extra="allow")
    type: str


def _tool_tag(value: Any) -> str | None:
    kind = declared_type(value)
    return None if kind is None else "function" if kind == "function" else "other"


Tool = Annotated[Annotated[FunctionTool, Tag("function")] | Annotated[_Tool, Tag("other")], Discriminator(_tool_tag)]
"""A tool: a function tool is validated whole (a malformed one is a 400 that names its field)."""


class TextFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")


class TextOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    format: TextFormat | None = None


class ReasoningOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    effort: str | None = None
    """Reaches the chat template (see :meth:`~.schemas.ChatCompletionRequest.template_kwargs`)."""
    summary: str | None = None
    """Ignored: the reasoning is returned whole, as ``reasoning_text`` content; no summary is written."""


def _bounded(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items bounded in their content parts too (a template renders each)."""
    check_parts(sum(len(item["content"]) for item in items if isinstance(item.get("content"), list)), "content parts")
    return items


class ResponsesRequest(BaseModel):
    """The fields mlxcel uses; others (``include``, ``store``, ``prompt_cache_key``,
    ``metadata``, ``truncation``, ``user``, ``service_tier``, ...) are accepted and ignored."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)
    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_MESSAGES), AfterValidator(_bounded)]
    instructions: str | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stream: bool = False
    text: TextOptions | None = None
    previous_response_id: str | None = None
    reasoning: ReasoningOptions | None = None

    def function_tools(self) -> list[FunctionTool]:
        """The function tools; other kinds (``web_search``, ``namespace``, ...) are not served and are dropped."""
        return [tool for tool in self.tools or [] if isinstance(tool, FunctionTool)]


def _text(content: Any, where: str) -> str:
    """A system message's content: its text parts (an image there is a 400: a system prompt is text)."""
    parts = _content(content, where)
    if isinstance(parts, str):
        return parts
    if any(part["type"] == "image_url" for part in parts):
        raise bad_request(f"{where}: a system or developer message holds text only", param="input")
    return "".join(part["text"] for part in parts)


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content as chat's: a string, or (with an ``input_image``) text and ``image_url`` parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts", param="input")
    parts: list[dict[str, Any]] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            parts.append({"type": "text", "text": str(part.get("text", ""))})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):  # a file_id names an uploaded file: there is no file store here
                raise bad_request(f"{where}: an input_image needs an image_url (a data: URL); file_id is not "
                                  "served", param="input", code="invalid_image")
            parts.append({"type": "image_url", "image_url": {"url": url}, "where": f"{where}.content"})
        elif kind in ("input_file", "input_audio"):
            raise bad_request(f"{where}: {kind} parts cannot be served", param="input")
    if all(part["type"] == "text" for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its ``reasoning_text`` content, else its summary (encrypted content is opaque)."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key)
        if isinstance(parts, list):
            text = "".join(str(p.get("text", "")) for p in parts if isinstance(p, dict) and p.get("type") == kind)
            if text:
                return text
    return ""


def _chat_messages(params: ResponsesRequest) -> list[dict[str, Any]]:
    items = [{"type": "message", "role": "user", "content": params.input}] if isinstance(params.input, str) \
        else params.input
    system = [params.instructions] if params.instructions else []
    chat: list[dict[str, Any]] = []
    thought = ""  # a reasoning item's text, for the assistant turn that follows it
    for index, item in enumerate(items):
        where = f"input.{index}"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role in ("system", "developer"):  # chat templates take one system message, first
                system.append(_text(item.get("content", ""), where))
            elif role in ("user", "assistant"):
                chat.append({"role": role, "content": _content(item.get("content", ""), where)})
                if role == "assistant" and thought:
                    chat[-1]["reasoning_content"], thought = thought, ""
            else:
                raise bad_request(f"{where}.role must be user, assistant, system or developer", param="input")
        elif kind == "function_call":
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": str(item.get("name", "")), "arguments": str(item.get("arguments", "{}"))}}
            if chat and chat[-1]["role"] == "assistant" and not thought:
                chat[-1].setdefault("tool_calls", []).append(call)
            else:
                chat.append({"role": "assistant", "content": "", "tool_calls": [call]})
                if thought:
                    chat[-1]["reasoning_content"], thought = thought, ""
        elif kind == "function_call_output":
            output = item.get("output", "")
            chat.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                         "content": output if isinstance(output, str) else _content(output, where)})
        elif kind == "reasoning":  # passed back: the template may render it with the turn it led to
            thought = _reasoning_text(item)
        elif kind is None:
            raise bad_request(f"{where} has no type", param="input")
        # other item types (web search calls, ...): nothing the template renders
    if not chat:
        raise bad_request("input: the conversation has no user or assistant turn to answer", param="input")
    system_text = "\n\n".join(s for s in system if s)
    return ([{"role": "system", "content": system_text}] if system_text else []) + chat


def to_chat(params: ResponsesRequest) -> dict[str, Any]:
    """The chat completions body that serves *params* (validated again there, with its bounds)."""
    if params.previous_response_id is not None:
        raise bad_request("previous_response_id needs a stored response, and this server stores none: send the "
                          "whole conversation in input (as with store: false)", param="previous_response_id")
    body: dict[str, Any] = {"messages": _chat_messages(params), "temperature": params.temperature,
                            "top_p": params.top_p, "stream": params.stream}
    if params.max_output_tokens is not None:
        body["max_tokens"] = params.max_output_tokens
    if params.reasoning is not None and params.reasoning.effort is not None:
        body["reasoning_effort"] = params.reasoning.effort
    tools = params.function_tools()
    if tools:
        body["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                         for tool in tools]
        if params.parallel_tool_calls is False:
            body["parallel_tool_calls"] = False
    # Passed on with or without tools: one that forces a call without any is chat's 400.
    choice = params.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice must be auto, none, required or {type: function, name}",
                              param="tool_choice")
        body["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        body["tool_choice"] = choice
    form = params.text.format if params.text is not None else None
    if form is not None and form.type != "text":
        body["response_format"] = {"type": "json_object"} if form.type == "json_object" else {
            "type": "json_schema", "json_schema": {"name": form.name or "response",
                                                   "schema": form.json_schema or {"type": "object"}}}
    return body
