"""One choice's events read as a chat turn: its reasoning, its text and its tool calls as they come, and how it
finished.

What every chat-shaped route shares (chat completions, Anthropic's Messages,
OpenAI's Responses): the reasoning split of :class:`~.reasoning.ReasoningSplit`
first, then the tool-call reading of :class:`~.tools.ToolCallReader` on the
answer, applied event by event or to the whole answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from ..engine import Event, Finish, TextDelta
from ..http.errors import ApiError
from .reasoning import ReasoningSplit, Thinking
from .tools import ToolCallReader, ToolSetup
from .wire import finish_error


class Piece(NamedTuple):
    """What one event adds: reasoning, answer text, and chat tool-call deltas (see :class:`~.tools.ToolCallReader`)."""

    reasoning: str
    text: str
    calls: list[dict[str, Any]]


class ChoiceReader:
    """Feed it the choice's text, or its events, in order; each gives the :class:`Piece` it adds."""

    def __init__(self, tools: ToolSetup | None, thinking: Thinking | None) -> None:
        self.split = ReasoningSplit(thinking) if thinking is not None else None
        self.reader = ToolCallReader(tools) if tools is not None else None
        self.finish: Finish | None = None
        self.reasoning_tokens = 0
        """Tokens generated while the reasoning was open (the marker that closed it included)."""

    @property
    def plain(self) -> bool:
        """The text is passed through as it comes: nothing to split or parse."""
        return self.split is None and self.reader is None

    def feed(self, text: str) -> Piece:
        reasoning, answer = self.split.feed(text) if self.split is not None else ("", text)
        return Piece(reasoning, *self._answer(answer, end=False))

    def end(self) -> Piece:
        """The rest, once the text has ended."""
        reasoning, answer = self.split.finish() if self.split is not None else ("", "")
        return Piece(reasoning, *self._answer(answer, end=True))

    def _answer(self, text: str, end: bool) -> tuple[str, list[dict[str, Any]]]:
        if self.reader is None:
            return text, []
        content, calls = self.reader.feed(text) if text else ("", [])
        if end:
            rest, more = self.reader.finish()
            content, calls = content + rest, calls + more
        return content, calls

    def read(self, event: Event) -> Piece:
        """The piece *event* adds (a :class:`Finish` is kept, and ends the text)."""
        if isinstance(event, TextDelta):
            before = self.split is not None and self.split.state == "reasoning"
            piece = self.feed(event.text)
            if before or (self.split is not None and self.split.state in ("reasoning", "after")):
                self.reasoning_tokens += len(event.token_ids)
            return piece
        if isinstance(event, Finish):
            self.finish = event
            return self.end()
        return Piece("", "", [])

    @property
    def calls(self) -> list[dict[str, Any]]:
        """Every call read so far, complete."""
        return self.reader.calls if self.reader is not None else []

    def failure(self, stopping: bool) -> ApiError | None:
        """The error of a choice that did not finish normally (see :func:`~.wire.finish_error`), if it did not."""
        if self.finish is None or self.finish.reason in ("error", "cancelled"):
            return finish_error(self.finish, stopping=stopping)[0]
        return None


@dataclass(frozen=True)
class Answer:
    """A whole choice, read."""

    reasoning: str
    text: str
    calls: list[dict[str, Any]]
    finish: Finish
    reasoning_tokens: int


async def read_whole(events: Any, tools: ToolSetup | None, thinking: Thinking | None, stopping: bool) -> Answer:
    """The whole answer of a one-choice request; a failure raises."""
    choice, reasoning, text = ChoiceReader(tools, thinking), "", ""
    async with events:
        async for _, event in events:
            piece = choice.read(event)
            reasoning, text = reasoning + piece.reasoning, text + piece.text
    failure = choice.failure(stopping)
    if failure is not None:
        raise failure
    assert choice.finish is not None
    return Answer(reasoning, text, choice.calls, choice.finish, choice.reasoning_tokens)
