"""What a start is doing, for ``/health``: the last progress line the worker's thread logs while it loads.

A start of a large pairing takes a minute (the weights, the row split's measurement, the exactness probes),
and ``/health`` answers 503 ``loading`` all along. Its ``loading`` field says where the start is, in the
words the log already uses ("loading M: 44% of tensors", "MTP batch exactness probe: 8 of 16 widths checked
(17s)"), so the two cannot disagree. Only the INFO lines of the loggers that report a start's steps are
taken (:data:`PROGRESS`): ``/health`` is public, and warnings and other modules' lines may name the cache's
paths. Lines below the log's level are not seen (``--log-level warning``: no ``loading``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..observability import Observability

#: The loggers whose INFO lines are a start's steps: the weights, the row split, the probes, the batch's set-up.
PROGRESS = frozenset({"mlxcel.models.loader", "mlxcel.engine.loading", "mlxcel.engine.speculation",
                      "mlxcel.engine.batch_mtp"})


class _LastLine(logging.Handler):
    def __init__(self, observability: Observability) -> None:
        super().__init__(logging.INFO)
        self._observability, self._thread = observability, threading.get_ident()

    def emit(self, record: logging.LogRecord) -> None:
        # This start's (not another model's loading beside it), and a step, not a warning.
        if record.thread == self._thread and record.levelno == logging.INFO and record.name in PROGRESS:
            self._observability.loading = record.getMessage()


@contextmanager
def reported(observability: Observability) -> Iterator[None]:
    """While open, *observability*'s ``loading`` is the last progress line logged on this thread; None after."""
    handler = _LastLine(observability)
    root = logging.getLogger("mlxcel")
    root.addHandler(handler)
    try:
        yield
    finally:
        root.removeHandler(handler)
        observability.loading = None
