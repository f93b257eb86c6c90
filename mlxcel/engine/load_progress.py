"""What a start is doing, for ``/health``: the last line mlxcel logs on the worker's thread while it loads.

A start of a large pairing takes a minute (the weights, the row split's measurement, the exactness probes),
and ``/health`` answers 503 ``loading`` all along. Its ``loading`` field says where the start is, in the
words the log already uses ("loading M: 44% of tensors", "MTP batch exactness probe: 8 of 16 widths checked
(17s)"), so the two cannot disagree. Lines below the log's level are not seen (``--log-level
warning`` keeps ``loading`` at its first line, or empty).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..observability import Observability


class _LastLine(logging.Handler):
    def __init__(self, observability: Observability) -> None:
        super().__init__(logging.INFO)
        self._observability, self._thread = observability, threading.get_ident()

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self._thread:  # this start's, not another model's loading beside it
            self._observability.loading = record.getMessage()


@contextmanager
def reported(observability: Observability) -> Iterator[None]:
    """While open, *observability*'s ``loading`` is the last line mlxcel logged on this thread; None after."""
    handler = _LastLine(observability)
    root = logging.getLogger("mlxcel")
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        observability.loading = None
