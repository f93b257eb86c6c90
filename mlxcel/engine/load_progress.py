"""What a start is doing, for ``/health``: the last progress line the worker's thread logs while it loads.

A start of a large pairing takes a minute (the weights, the row split's measurement, the exactness probes),
and ``/health`` answers 503 ``loading`` all along. Its ``loading`` field says where the start is, in the
words the log already uses ("loading M: 44% of tensors", "MTP batch exactness probe: 8 of 16 widths checked
(17s)"), so the two cannot disagree. Only the INFO lines of the loggers that report a start's steps are
taken (:data:`PROGRESS`): ``/health`` is public, and warnings and other modules' lines may name the cache's
paths.

The lines are taken by a filter on each of those loggers (:class:`_Tap`), not by a handler: a handler sees
only what the log's level lets through, and ``--log-level warning`` would leave ``/health`` without them.
While any start loads, those loggers are let down to INFO and the filter passes on to the log's handlers only
what the log's own level would have (it drops the rest once taken). Several models may load at once, each
on its own thread: one filter serves them all, installed by the first and taken out by the last.
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


class _Tap(logging.Filter):
    """Takes each loading thread's INFO lines of a :data:`PROGRESS` logger, and passes on what the log's level
    lets through."""

    def __init__(self, levels: dict[str, int], own: dict[str, int]) -> None:
        super().__init__()
        self.levels, self.own = levels, own
        """Each logger's effective level, and its own level (to restore), before it was let down."""
        self.loading: dict[int, Observability] = {}  # thread -> the observability its start reports to

    def filter(self, record: logging.LogRecord) -> bool:
        observability = self.loading.get(record.thread or 0)
        if observability is not None and record.levelno == logging.INFO:  # a step, not a warning
            observability.loading = record.getMessage()
        return record.levelno >= self.levels.get(record.name, logging.NOTSET)


_lock = threading.Lock()
_tap: _Tap | None = None


@contextmanager
def reported(observability: Observability) -> Iterator[None]:
    """While open, *observability*'s ``loading`` is the last progress line logged on this thread; None after."""
    global _tap
    thread = threading.get_ident()
    with _lock:
        if _tap is None:
            loggers = [logging.getLogger(name) for name in sorted(PROGRESS)]
            _tap = _Tap({logger.name: logger.getEffectiveLevel() for logger in loggers},
                        {logger.name: logger.level for logger in loggers})
            for logger in loggers:
                logger.addFilter(_tap)
                if logger.getEffectiveLevel() > logging.INFO:
                    logger.setLevel(logging.INFO)
        tap = _tap
        tap.loading[thread] = observability
    try:
        yield
    finally:
        with _lock:
            del tap.loading[thread]
            if not tap.loading:
                for name in sorted(PROGRESS):
                    logger = logging.getLogger(name)
                    logger.removeFilter(tap)
                    if tap.levels[name] > logging.INFO:
                        logger.setLevel(tap.own[name])
                _tap = None
        observability.loading = None
