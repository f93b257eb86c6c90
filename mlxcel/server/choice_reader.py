"""One choice's events read as a chat turn: its text and tool calls as they come, and how it finished.

What the routes that serve another API's shapes over a chat completion share
(Anthropic's Messages, OpenAI's Responses): the tool-call reading of
:class:`~.tools.ToolCallReader`, applied event by event or to the whole answer.
"""

from __future__ import annotations

from typing import Any

from ..engine import Event, Finish, TextDelta
from ..http.errors import ApiError
from .tools import ToolCallReader, ToolSetup
from .wire import finish_error


class ChoiceReader:
    """Feed it the choice's events in order; each gives the text and tool-call deltas it adds."""

    def __init__(self, tools: ToolSetup | None) -> None:
        self.reader = ToolCallReader(tools) if tools is not None else None
        self.finish: Finish | None = None

    def read(self, event: Event) -> tuple[str, list[dict[str, Any]]]:
        """The text and the chat tool-call deltas (see :class:`~.tools.ToolCallReader`) that *event* adds."""
        if isinstance(event, TextDelta):
            return (event.text, []) if self.reader is None else self.reader.feed(event.text)
        if isinstance(event, Finish):
            self.finish = event
            return ("", []) if self.reader is None else self.reader.finish()
        return "", []

    @property
    def calls(self) -> list[dict[str, Any]]:
        """Every call read so far, complete."""
        return self.reader.calls if self.reader is not None else []

    def failure(self, stopping: bool) -> ApiError | None:
        """The error of a choice that did not finish normally (see :func:`~.wire.finish_error`), if it did not."""
        if self.finish is None or self.finish.reason in ("error", "cancelled"):
            return finish_error(self.finish, stopping=stopping)[0]
        return None


async def read_whole(events: Any, tools: ToolSetup | None, stopping: bool) -> tuple[str, list[dict[str, Any]], Finish]:
    """The whole answer of a one-choice request: its text, its tool calls and its finish; a failure raises."""
    choice, text = ChoiceReader(tools), ""
    async with events:
        async for _, event in events:
            text += choice.read(event)[0]
    failure = choice.failure(stopping)
    if failure is not None:
        raise failure
    assert choice.finish is not None
    return text, choice.calls, choice.finish
