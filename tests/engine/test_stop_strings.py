"""StopStringFilter against a naive oracle, and its cost with long stop strings.

The oracle works on the whole concatenated text, one end position at a time,
with `str.endswith` only: it shares no code or idea with the filter's
streaming matchers.
"""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from mlxcel.engine.text import StopStringFilter

# Few symbols, so that pieces and stop strings overlap often; multi-byte in
# UTF-8, astral, combining, zero-width and control characters among them.
ALPHABET = ["a", "b", "é", "😀", "\u0301", "\u200d", "\n", "\x00"]


def oracle_output(text: str, stops: list[str]) -> tuple[str, bool]:
    """The contract on the whole text: stop at the first character that completes a
    stop string, cutting the longest stop string ending there; else all of it."""
    stops = [s for s in stops if s]
    for end in range(1, len(text) + 1):
        ending = [len(s) for s in stops if text.endswith(s, 0, end)]
        if ending:
            return text[:end - max(ending)], True
    return text, False


def oracle_hold(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of *text* that is a proper prefix of some stop string."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def check_run(pieces: list[str], stops: list[str]) -> None:
    """Feed *pieces* one by one; after each, the output so far is exactly what the oracle allows."""
    stop = StopStringFilter(tuple(stops))
    emitted = ""
    fed = ""
    final, will_stop = oracle_output("".join(pieces), stops)
    for piece in pieces:
        emitted += stop.feed(piece)
        fed += piece
        expected, stopped = oracle_output(fed, stops)
        assert stop.stopped == stopped
        if stopped:
            assert emitted == expected == final
        else:
            # Everything but the text that could still begin a stop string, and nothing of that.
            assert emitted == fed[:len(fed) - oracle_hold(fed, stops)]
        assert final.startswith(emitted)  # nothing emitted is ever taken back
    emitted += stop.flush()
    assert emitted == final
    assert stop.stopped == will_stop
    assert stop.flush() == ""


symbols = st.text(st.sampled_from(ALPHABET), max_size=8)


@st.composite
def runs(draw: st.DrawFn) -> tuple[list[str], list[str]]:
    """Pieces (empty ones included), and stop strings that are often slices of their text."""
    pieces = draw(st.lists(symbols, max_size=10))
    text = "".join(pieces)
    slices = st.tuples(st.integers(0, len(text)), st.integers(0, 6)).map(lambda t: text[t[0]:t[0] + t[1]])
    stops = draw(st.lists(symbols | slices, max_size=5))
    return pieces, stops


@settings(max_examples=600, deadline=None)
@given(runs())
def test_the_filter_follows_the_oracle(run: tuple[list[str], list[str]]) -> None:
    check_run(*run)


@settings(max_examples=200, deadline=None)
@given(runs(), st.data())
def test_the_output_does_not_depend_on_how_the_text_was_cut(run: tuple[list[str], list[str]],
                                                           data: st.DataObject) -> None:
    pieces, stops = run
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    recut = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    outputs = []
    for split in (pieces, recut, list(text)):
        stop = StopStringFilter(tuple(stops))
        outputs.append("".join(stop.feed(p) for p in split) + stop.flush())
    assert outputs[0] == outputs[1] == outputs[2] == oracle_output(text, stops)[0]


def test_a_stop_string_spanning_pieces_is_held_then_dropped() -> None:
    stop = StopStringFilter(("</s>",))
    assert stop.feed("Hello <") == "Hello "
    assert stop.feed("/") == ""
    assert stop.feed("s> and more") == ""
    assert stop.stopped
    assert stop.feed("later") == "" and stop.flush() == ""


def test_held_text_that_turns_out_not_to_be_a_stop_string_is_released() -> None:
    stop = StopStringFilter(("</s>",))
    assert stop.feed("a </") == "a "
    assert stop.feed("b") == "</b"
    assert stop.feed("<") == ""
    assert stop.flush() == "<"
    assert not stop.stopped


def test_the_first_completed_stop_string_wins_and_the_longest_of_those_ending_there() -> None:
    # "ab" is complete before "abc" could be: the filter does not wait for the longer one.
    check_run(["a", "bc"], ["abc", "ab"])
    stop = StopStringFilter(("abc", "ab"))
    assert stop.feed("xabc") == "x"
    # Overlapping: "bc" ends first, although "abcd" would have begun earlier.
    stop = StopStringFilter(("abcd", "bc"))
    assert stop.feed("abcd") == "a"
    # Both end at the same character: the longer one is cut.
    stop = StopStringFilter(("b", "ab"))
    assert stop.feed("xab") == "x"


def test_multi_byte_and_combining_characters() -> None:
    # "e" + combining acute is not the precomposed "é": the filter matches code points, not glyphs.
    stop = StopStringFilter(("é",))
    assert stop.feed("caf") == "caf"
    assert stop.feed("e\u0301") == "e\u0301"
    assert stop.feed("😀é!") == "😀"
    assert stop.stopped
    check_run(["😀\u200d", "😀", "\u200d😀x"], ["\u200d😀\u200d", "😀x"])


def test_empty_and_absent_stop_strings_pass_everything_through() -> None:
    for stops in ((), ("",), ("", "")):
        stop = StopStringFilter(stops)
        assert stop.feed("") == "" and stop.feed("abc") == "abc"
        assert stop.flush() == "" and not stop.stopped


def test_a_repetitive_stop_string_falls_back_to_its_longest_border() -> None:
    # "aab" after "aaa...": the matcher must keep the border "aa", not restart from zero.
    check_run(["a"] * 5 + ["b", "x"], ["aab"])
    check_run(["ab", "aba", "bab", "ab"], ["ababab", "babb"])


def test_long_stop_strings_cost_linear_work() -> None:
    """Four stop strings of 200 k characters, and 2 000 tokens that keep matching their prefix.

    The quadratic hold-back this replaced took about 0.2 s per token for ONE
    such stop string (about half an hour for this test). The filter's work is
    linear in the text fed: about a second on a loaded two-core machine. The
    bound is generous, in CPU time of this process, so other processes do not count.
    """
    length = 200_000
    stops = tuple("a" * (length - 1) + chr(ord("b") + i) for i in range(4))
    start = time.process_time()
    stop = StopStringFilter(stops)
    out = ""
    for _ in range(1_000):
        out += stop.feed("a" * 20)  # held back: it may still be any stop string's start
    assert out == "" and not stop.stopped
    assert stop.feed("z") == "a" * 20_000 + "z"  # released in one piece: no stop string begins there
    for _ in range(1_010):
        out += stop.feed("a" * 199)
    out += stop.feed("c")  # completes the second stop string
    elapsed = time.process_time() - start
    assert stop.stopped and out == "a" * (1_010 * 199 - (length - 1))
    assert elapsed < 20.0, f"{elapsed:.1f} s of CPU time: the filter is no longer linear"
