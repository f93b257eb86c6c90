"""Reasoning: a thinking model's leading think block, read apart from its answer.

Thinking models (Qwen 3.x, GLM, DeepSeek R1, Gemma 4's thought channel, ...)
write their reasoning between two markers before the answer; mlx-lm's tokenizer
wrapper names them from the vocabulary (``think_start`` / ``think_end``). Many
chat templates open the block themselves, at the end of the generation prompt
(Qwen 3.5's ``<think>\\n``), so the model's text starts inside it: whether it
does is read from the prompt's last tokens (:func:`thinking`).

Only a *leading* block is reasoning: text that starts with anything else is the
answer, markers and all (a model quoting ``<think>`` in its answer is not
thinking). Whitespace around the block is dropped, as templates drop it when
they render the reasoning back. The routes send the reasoning as chat
completions' ``reasoning_content`` and ``reasoning``, as Anthropic's ``thinking``
blocks and as the Responses API's ``reasoning`` items.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

TAIL = 32
"""Prompt tokens searched for an open think block: a template opens it in its generation prompt, at the end."""


@dataclass(frozen=True)
class Thinking:
    """A thinking model's markers, and whether the prompt left a block open."""

    start: str
    end: str
    open: bool
    """The prompt ends inside a think block (the template opened it): the output starts as reasoning."""


def _last(tokens: Sequence[int], marker: Sequence[int]) -> int:
    """Where *marker* last starts in *tokens*, or -1."""
    n = len(marker)
    for at in range(len(tokens) - n, -1, -1):
        if tuple(tokens[at:at + n]) == tuple(marker):
            return at
    return -1


def thinking(tokenizer: Any, prompt: Sequence[int]) -> Thinking | None:
    """The reasoning markers of *tokenizer*'s model (None: it does not think), read against *prompt*."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    tail = prompt[-TAIL:]
    opened = _last(tail, tokenizer.think_start_tokens)
    return Thinking(tokenizer.think_start, tokenizer.think_end,
                    open=opened >= 0 and _last(tail, tokenizer.think_end_tokens) < opened)


State = Literal["before", "reasoning", "after", "answer"]


class ReasoningSplit:
    """One choice's text in, as it streams; its reasoning and its answer out.

    :meth:`feed` and :meth:`finish` return ``(reasoning, answer)`` to send now.
    Text that could still be the start of a marker, or whitespace that may end
    the reasoning, is held until the next feed shows what it is.
    """

    def __init__(self, marks: Thinking) -> None:
        self.marks = marks
        self.state: State = "reasoning" if marks.open else "before"
        self._held = ""
        self._started = False
        """Some reasoning was sent: whitespace before it is dropped, whitespace inside kept."""

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning = answer = ""
        while True:
            if self.state == "before":
                lead = self._held.lstrip()
                if lead.startswith(self.marks.start):
                    self._held, self.state = lead[len(self.marks.start):], "reasoning"
                    continue
                if self.marks.start.startswith(lead):  # nothing yet, or maybe the marker's start
                    break
                answer, self._held, self.state = self._held, "", "answer"
            elif self.state == "reasoning":
                at = self._held.find(self.marks.end)
                if at >= 0:
                    reasoning += self._said(self._held[:at].rstrip())
                    self._held, self.state = self._held[at + len(self.marks.end):], "after"
                    continue
                keep = _marker_prefix(self._held, self.marks.end)
                body = self._held[:len(self._held) - keep]
                sent = body.rstrip()  # whitespace that may turn out to end the reasoning waits
                reasoning += self._said(sent)
                self._held = body[len(sent):] + self._held[len(body):]
                break
            elif self.state == "after":
                self._held = self._held.lstrip()
                if self._held:
                    self.state = "answer"
                    continue
                break
            else:
                answer, self._held = answer + self._held, ""
                break
        return reasoning, answer

    def _said(self, text: str) -> str:
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        return text

    def finish(self) -> tuple[str, str]:
        """The rest, once the text has ended (reasoning cut off by ``max_tokens`` stays reasoning)."""
        rest, self._held = self._held, ""
        if self.state == "reasoning":
            return self._said(rest.rstrip()), ""
        if self.state == "after":
            return "", ""
        return "", rest


def _marker_prefix(text: str, marker: str) -> int:
    """The length of the longest end of *text* that begins *marker* (and may be completed by what comes)."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)
