"""Incremental text with stop strings, per request. Pure Python."""

from __future__ import annotations


class StopStringFilter:
    """Passes text through until a stop string appears, holding back what could start one.

    Text that might be the beginning of a stop string is not emitted until the
    next piece shows whether it is; the stop string itself is never emitted.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of *text* (after what was held back) that is safe to emit."""
        if self.stopped:
            return ""
        buffer = self._held + text
        if not self._stops:
            self._held = ""
            return buffer
        cut = min((i for s in self._stops if (i := buffer.find(s)) >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._held = ""
            return buffer[:cut]
        hold = max((n for s in self._stops for n in range(1, len(s))
                    if buffer.endswith(s[:n])), default=0)
        self._held = buffer[len(buffer) - hold:] if hold else ""
        return buffer[:len(buffer) - hold]

    def flush(self) -> str:
        """What is still held back, once no more text will come."""
        held, self._held = ("" if self.stopped else self._held), ""
        return held
