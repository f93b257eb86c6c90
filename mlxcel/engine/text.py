"""Incremental text with stop strings, per request. Pure Python.

The filter runs on the MLX thread once per token, and a request may carry
long stop strings, so its cost per token must not grow with the square of
their length. Each stop string gets a streaming Knuth-Morris-Pratt matcher:
one character costs amortised O(1) per stop string, whatever its length, and
the matcher's state is exactly the length of text that has to be held back.
"""

from __future__ import annotations

from array import array


class _Matcher:
    """Streaming Knuth-Morris-Pratt for one non-empty pattern.

    Invariant: `matched` is the length of the longest suffix of the text seen
    so far that is a prefix of `pattern`. The failure table (the prefix
    function: `failure[i]` is the length of the longest proper border of
    `pattern[:i + 1]`) is built lazily, one entry each time `matched` reaches a
    new length, so a stop string of 200 k characters costs nothing up front and
    only as much as the text that actually matched it.
    """

    __slots__ = ("_failure", "matched", "pattern")

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.matched = 0
        self._failure = array("i", [0])  # 4 bytes an entry, not a boxed int

    def advance(self, char: str) -> bool:
        """Take one more character of text; true when the whole pattern now ends here.

        After a full match the matcher is spent: the filter stops, so it is never fed again.
        """
        pattern, failure, j = self.pattern, self._failure, self.matched
        while j and pattern[j] != char:
            j = failure[j - 1]
        if pattern[j] == char:
            j += 1
        self.matched = j
        if j == len(pattern):
            return True
        if len(failure) < j:
            self._extend_failure()
        return False

    def _extend_failure(self) -> None:
        # The textbook prefix-function step for index i = len(failure); entries
        # below i exist. Amortised O(1): the same argument as building it eagerly.
        pattern, failure = self.pattern, self._failure
        i = len(failure)
        k = failure[i - 1]
        while k and pattern[i] != pattern[k]:
            k = failure[k - 1]
        failure.append(k + 1 if pattern[i] == pattern[k] else k)


class StopStringFilter:
    """Passes text through until a stop string appears, holding back what could start one.

    The result depends only on the concatenated text, not on how it was cut
    into pieces:

    - the filter stops at the first character that completes a stop string;
      if several stop strings end there, the longest one is cut (so the
      output is the text before it), and the rest of that piece is dropped;
    - until then, everything is emitted except the longest suffix of the text
      so far that is a proper prefix of some stop string: that suffix is held
      back until later text shows whether it is one; `flush` returns it once no
      more text will come;
    - the stop string itself is never emitted. Empty stop strings are ignored.

    Each character of text costs amortised O(number of stop strings); a
    single `feed` of m characters costs at most O(total stop length + m x the
    number of stop strings), the first term being the matchers falling back
    and the held text copied once.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        # dict.fromkeys: drop duplicates, keep order (matching twice would double the work).
        self._matchers = tuple(_Matcher(s) for s in dict.fromkeys(stops) if s)
        self._held = ""
        self.stopped = False
        self.matched: str | None = None
        """The stop string that ended the text (the longest of those ending at that character)."""

    def feed(self, text: str) -> str:
        """The part of *text* (after what was held back) that is safe to emit."""
        if self.stopped:
            return ""
        if not self._matchers:
            return text
        buffer = self._held + text
        start = len(self._held)  # where *text* begins in the buffer
        for offset, char in enumerate(text):
            longest = 0
            for matcher in self._matchers:
                if matcher.advance(char) and len(matcher.pattern) > longest:
                    longest, self.matched = len(matcher.pattern), matcher.pattern
            if longest:
                self.stopped = True
                self._held = ""
                # The stop string began within the held text or this piece: the held
                # text is at least as long as any proper prefix of it seen so far.
                return buffer[:start + offset + 1 - longest]
        hold = max(matcher.matched for matcher in self._matchers)
        self._held = buffer[len(buffer) - hold:] if hold else ""
        return buffer[:len(buffer) - hold]

    def flush(self) -> str:
        """What is still held back, once no more text will come (nothing after a stop)."""
        held, self._held = ("" if self.stopped else self._held), ""
        for matcher in self._matchers:
            matcher.matched = 0  # the held text is gone: keep `held` and the matchers in step
        return held
