"""Tool calling: the request's tools into the chat template, the model's tool calls out of its text.

Three ways a request can want tools (``tool_choice``):

- ``auto``: the model decides. Its text is read with the tool-call format of
  its family, which mlx-lm's tokenizer wrapper names from the chat template
  (``tool_call_start`` / ``tool_call_end`` and a parser from
  ``mlx_lm.tool_parsers``: Qwen/Hermes ``<tool_call>{json}</tool_call>``,
  Gemma 4's ``<|tool_call>call:name{...}<tool_call|>``, GLM's ``<arg_key>``
  form, ...). Text between the markers that the parser cannot read stays text.
- a named function: constrained decoding forces a JSON object that matches
  that function's ``parameters``; it is the call's ``arguments``, streamed as
  it comes (vLLM's rule; it works whatever the family's own format).
- ``required``: constrained decoding forces a JSON array of one or more
  ``{"name", "arguments"}``, each naming one of the tools (vLLM's shape too).

``none`` renders the chat without the tools (vLLM's ``--exclude-tools-when-
tool-choice-none``): text only. The reader below turns one choice's text,
as it streams, into content and OpenAI tool calls.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ..http.errors import bad_request
from .schemas import json_problem

ToolMode = Literal["auto", "named", "required"]


@dataclass(frozen=True)
class ToolSetup:
    """How one request's output is read for tool calls."""

    mode: ToolMode
    tools: list[dict[str, Any]]
    """The request's tools as the client sent them (parsers look up parameter types in them)."""
    name: str | None = None
    """The forced function (mode ``named``)."""
    start: str = ""
    end: str = ""
    parse: Callable[[str, Any], Any] | None = None
    """mlx-lm's parser of the text between *start* and *end* (mode ``auto``)."""
    single: bool = False
    """``parallel_tool_calls: false``: at most one call."""


def template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """The request's messages as chat templates read them (Hugging Face's conventions).

    Templates serialize an assistant's call arguments themselves (``| tojson``),
    so a JSON string of arguments is handed over as the object it spells. A
    message with images is a list of ``text`` and ``image`` parts, in order
    (a vision model's template writes its image marker for each).
    """
    out = []
    for message in messages:
        entry: dict[str, Any] = {"role": message.role, "content": message.text()}
        if message.images():
            entry["content"] = [{"type": "image"} if part.type == "image_url" else {"type": "text", "text": part.text}
                                for part in message.content]
        if message.tool_calls:
            entry["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": _arguments_object(call.function.arguments)}}
                for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            entry["name"] = message.name
        reasoning = message.reasoning_content or message.reasoning
        if reasoning and message.role == "assistant":
            entry["reasoning_content"] = reasoning
        out.append(entry)
    return out


def _arguments_object(arguments: str) -> Any:
    """A call's ``arguments`` as the object chat templates expect, or the string when it is not one.

    Nested past what a body may be (``MAX_JSON_DEPTH``), it is a 400: the template would recurse into it.
    """
    try:
        value = json.loads(arguments)
    except RecursionError:
        value = None
        problem: str | None = "nests arrays and objects too deeply"
    except ValueError:
        return arguments
    else:
        problem = json_problem(value)
    if problem is not None:
        raise bad_request(f"a tool call's function.arguments: {problem.removeprefix('the request body ')}",
                          param="messages")
    return value if isinstance(value, dict) else arguments


def new_call(name: str, arguments: str) -> dict[str, Any]:
    """An OpenAI tool call (``ChatCompletionMessageToolCall``)."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _arguments_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


@dataclass
class ToolCallReader:
    """One choice's text in (as it streams), its content and tool calls out.

    :meth:`feed` and :meth:`finish` return what to send now: content text, and
    stream deltas of tool calls (``ChatCompletionMessageToolCallChunk``, with
    ``index``). :attr:`calls` collects the complete calls for a message.
    """

    setup: ToolSetup
    calls: list[dict[str, Any]] = field(default_factory=list)
    _buffer: str = ""
    _in_call: bool = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        mode = self.setup.mode
        if mode == "named":
            return "", self._named(text)
        if mode == "required":
            self._buffer += text  # an array: read whole at the end
            return "", []
        return self._auto(text)

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The rest, once the text has ended (a call cut off by ``max_tokens`` stays text when unreadable)."""
        mode, rest = self.setup.mode, self._buffer
        self._buffer = ""
        if mode == "named":
            return "", [] if self.calls else self._named("")
        if mode == "required":
            return self._required(rest)
        if not self._in_call:
            return rest, []
        self._in_call = False
        deltas = self._parsed(rest)
        return ("" if deltas is not None else self.setup.start + rest), deltas or []

    def _named(self, text: str) -> list[dict[str, Any]]:
        assert self.setup.name is not None
        if not self.calls:
            call = new_call(self.setup.name, "")
            self.calls.append(call)
            first = {"index": 0, **json.loads(json.dumps(call))}
            first["function"]["arguments"] = text
            call["function"]["arguments"] = text
            return [first]
        if not text:
            return []
        self.calls[0]["function"]["arguments"] += text
        return [{"index": 0, "function": {"arguments": text}}]

    def _required(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        try:
            items = json.loads(text)
        except ValueError:
            return text, []  # cut off by max_tokens: not an array of calls
        if not isinstance(items, list):
            return text, []
        deltas = []
        for item in items[:1] if self.setup.single else items:
            if isinstance(item, dict) and isinstance(item.get("name"), str):
                deltas.append(self._add(item["name"], _arguments_text(item.get("arguments", {}))))
        return "", deltas

    def _auto(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        start, end = self.setup.start, self.setup.end
        self._buffer += text
        content, deltas = "", []
        while True:
            if not self._in_call:
                at = self._buffer.find(start)
                if at < 0:  # hold back what could be the start of a marker
                    keep = next((n for n in range(min(len(start) - 1, len(self._buffer)), 0, -1)
                                 if start.startswith(self._buffer[-n:])), 0)
                    content += self._buffer[:len(self._buffer) - keep]
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    break
                content += self._buffer[:at]
                self._buffer, self._in_call = self._buffer[at + len(start):], True
            else:
                at = self._buffer.find(end)
                if at < 0:
                    break
                body, self._buffer, self._in_call = self._buffer[:at], self._buffer[at + len(end):], False
                parsed = self._parsed(body)
                if parsed is None:
                    content += start + body + end
                else:
                    deltas += parsed
        return content, deltas

    def _parsed(self, body: str) -> list[dict[str, Any]] | None:
        """The stream deltas of the calls in *body*, or None when the family's parser cannot read it."""
        assert self.setup.parse is not None
        try:
            parsed = self.setup.parse(body, self.setup.tools)
        except Exception:  # the parsers raise what their JSON or regex code raises
            return None
        found = parsed if isinstance(parsed, list) else [parsed]
        if not found or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in found):
            return None
        if self.setup.single:
            found = found[:max(0, 1 - len(self.calls))]
        return [self._add(c["name"], _arguments_text(c.get("arguments", {}))) for c in found]

    def _add(self, name: str, arguments: str) -> dict[str, Any]:
        call = new_call(name, arguments)
        self.calls.append(call)
        return {"index": len(self.calls) - 1, **json.loads(json.dumps(call))}


class ToolProblem(ValueError):
    """Tools this request or this model cannot serve; the message says why (a 400 on ``tools``)."""


def tool_setup(mode: str, tools: list[dict[str, Any]], choice_name: str | None, single: bool,
               tokenizer: Any) -> ToolSetup | None:
    """How to read the output of a request with *tools* in *mode* (None: ``none``, text only).

    Tools are only worth sending to a chat template that renders them; ``auto``
    also needs the family's tool-call format, which mlx-lm's tokenizer wrapper
    finds from the template (``has_tool_calling``).
    """
    if mode == "none":
        return None
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "tools" not in template:
        raise ToolProblem("this model's chat template does not render tools")
    if mode == "named":
        names = {t["function"]["name"] for t in tools}
        if choice_name not in names:
            raise ToolProblem(f"tool_choice names the function {choice_name!r}, which is not among the tools")
        return ToolSetup("named", tools, name=choice_name, single=True)
    if mode == "required":
        return ToolSetup("required", tools, single=single)
    if not getattr(tokenizer, "has_tool_calling", False):
        raise ToolProblem("this model has no known tool-call format to read its calls with (mlx-lm names "
                          "none for its chat template); tool_choice 'required' or a named function still work")
    return ToolSetup("auto", tools, start=tokenizer.tool_call_start, end=tokenizer.tool_call_end,
                     parse=tokenizer.tool_parser, single=single)
