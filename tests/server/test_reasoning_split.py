"""The reasoning split on its own: a thinking model's text in, its reasoning and answer out, however it streams."""

from __future__ import annotations

import pytest

from mlxcel.server.reasoning import ReasoningSplit, Thinking, thinking

QWEN = Thinking("<think>", "</think>", open=False)
GEMMA = Thinking("<|channel>thought", "<channel|>", open=False)


def _split(marks: Thinking, pieces: list[str]) -> tuple[str, str]:
    split, reasoning, answer = ReasoningSplit(marks), "", ""
    for piece in pieces:
        r, a = split.feed(piece)
        reasoning, answer = reasoning + r, answer + a
    r, a = split.finish()
    return reasoning + r, answer + a


CASES = [
    # (markers, the model's text, reasoning, answer)
    (QWEN, "<think>\nLet me see.\n</think>\n\nHello.", "Let me see.", "Hello."),
    (QWEN, "\n<think>a <b> c\n\nd</think>Hi", "a <b> c\n\nd", "Hi"),
    (QWEN, "Hello <think>not this</think>", "", "Hello <think>not this</think>"),
    (QWEN, "<thin", "", "<thin"),  # cut off where it might have become a marker: it is the answer
    (QWEN, "<think>cut off by max_tokens\n", "cut off by max_tokens", ""),
    (QWEN, "<think></think>   ", "", ""),
    (Thinking("<think>", "</think>", open=True), "\nLet me see.</think>\nHello.", "Let me see.", "Hello."),
    (Thinking("<think>", "</think>", open=True), "No end marker", "No end marker", ""),
    (GEMMA, "<|channel>thought\nPlan.<channel|>Done.", "Plan.", "Done."),
]


@pytest.mark.parametrize(("marks", "text", "reasoning", "answer"), CASES)
def test_split_is_the_same_whole_and_streamed_at_every_cut(marks: Thinking, text: str, reasoning: str,
                                                           answer: str) -> None:
    assert _split(marks, [text]) == (reasoning, answer)
    assert _split(marks, list(text)) == (reasoning, answer)  # a character at a time
    for cut in range(1, len(text)):
        for second in range(cut, len(text)):
            assert _split(marks, [text[:cut], text[cut:second], text[second:]]) == (reasoning, answer), (cut, second)


def test_reasoning_streams_before_its_end_is_seen() -> None:
    split = ReasoningSplit(QWEN)
    assert split.feed("<think>First") == ("First", "")
    assert split.feed(" thought.\n") == (" thought.", "")  # the newline waits: it may end the reasoning
    assert split.feed("More</th") == ("\nMore", "")  # it did not; "</th" waits: it may be the marker
    assert split.feed("ink>Answer") == ("", "Answer")


class _Tokenizer:
    """What :func:`thinking` reads of mlx-lm's tokenizer wrapper."""

    has_thinking = True
    think_start, think_end = "<think>", "</think>"
    think_start_tokens, think_end_tokens = (7,), (8,)


@pytest.mark.parametrize(("prompt", "opened"), [
    ([1, 2, 3, 7, 4], True),  # the generation prompt opened a block
    ([1, 7, 5, 8, 4], False),  # an earlier block, closed
    ([7] + [1] * 40, False),  # a start further back than a generation prompt reaches is history
    ([1, 2, 3], False),
])
def test_the_prompt_decides_whether_the_output_starts_as_reasoning(prompt: list[int], opened: bool) -> None:
    marks = thinking(_Tokenizer(), prompt)
    assert marks is not None and marks.open is opened


def test_a_model_without_markers_does_not_think() -> None:
    assert thinking(object(), [1, 2, 3]) is None
