"""Arrivals that wait, before the scheduler sees them, while their prompts' entries are read off the disk tier.

A prompt that an entry on the prefix cache's disk tier serves used to be read
back in the worker's turn, and every stream stood still meanwhile. Now the
worker hands such an arrival here: :class:`ReadAhead` holds its ``Submit``
back while the disk tier's reader thread reads and sums the entry's files
(:mod:`.disk_reads`), and passes it on to the scheduler once that is done, in
a drain of the inbox that the read's end wakes (:class:`.messages.ReadDone`).
The rows of the batch step meanwhile. An arrival that nothing on disk serves,
or whose read is done already, is not held. A cancel of a held arrival ends it
here; a stop passes every held arrival on with it, so that the scheduler ends
them as it ends the stop's other arrivals (and what follows a stop, the
scheduler reads no further than here). Worker thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from .messages import Cancel, Inbound, Message, ReadDone, Stop, Submit
from .requests import Finish, GenerationRequest, cancelled_unadmitted


class ReadAhead:
    """Arrivals held while their entries are read. *read*: the read of a request's entry, started (None when
    there is nothing to read); *wake*: called when a held arrival's read ends (on the reader thread, or on this
    one if it ended first), to wake the worker."""

    def __init__(self, read: Callable[[GenerationRequest], Future[Any] | None], wake: Callable[[], None]) -> None:
        self._read, self._wake = read, wake
        self._held: dict[str, tuple[Submit, Future[Any]]] = {}  # in arrival order

    def __len__(self) -> int:
        return len(self._held)

    def sort(self, messages: Iterable[Inbound]) -> tuple[list[Message], list[tuple[str, Finish]]]:
        """(the messages for the scheduler, the held arrivals that end here): the arrivals whose reads are done
        first, in arrival order, then *messages* less the arrivals held back and the wake-ups."""
        done = [request_id for request_id, (_, read) in self._held.items() if read.done()]
        passed: list[Message] = [self._held.pop(request_id)[0] for request_id in done]
        ended: list[tuple[str, Finish]] = []
        for message in messages:
            if isinstance(message, ReadDone):
                continue
            if isinstance(message, Stop):  # what follows it, the scheduler does not read either
                passed += [*(submit for submit, _ in self._held.values()), message]
                self._held.clear()
                break
            if isinstance(message, Cancel) and message.request_id in self._held:
                submit, _ = self._held.pop(message.request_id)
                ended.append((message.request_id, cancelled_unadmitted(submit.request)))
                continue
            if isinstance(message, Submit):
                read = self._read(message.request)
                if read is not None and not read.done():
                    self._held[message.request.id] = (message, read)
                    read.add_done_callback(lambda _: self._wake())
                    continue
            passed.append(message)
        return passed, ended
