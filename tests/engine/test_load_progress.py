"""What ``/health`` says a start is doing (:mod:`mlxcel.engine.load_progress`): the last progress line the loading
thread logged, never another thread's, a warning, or another module's line, and nothing once the load ends."""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from mlxcel.engine.load_progress import reported


def test_the_last_progress_line_of_the_loading_thread_and_none_after(caplog: pytest.LogCaptureFixture) -> None:
    observability: Any = SimpleNamespace(loading=None)  # the one attribute the load writes
    loader, probe = logging.getLogger("mlxcel.models.loader"), logging.getLogger("mlxcel.engine.batch_mtp")
    caplog.set_level(logging.INFO, logger="mlxcel")
    with reported(observability):
        loader.info("loading %s: %d%% of tensors", "m", 44)
        assert observability.loading == "loading m: 44% of tensors"
        probe.info("MTP batch exactness probe: %d of %d widths checked (%.0fs)", 8, 16, 17.2)
        assert observability.loading == "MTP batch exactness probe: 8 of 16 widths checked (17s)"
        # Not progress: a warning (it may name a path), another module's line, another model's start.
        probe.warning("ignoring the batch's step costs in /home/someone/.cache/x.batch.json: it is too large")
        logging.getLogger("mlxcel.engine.prompt_disk").info("prompt cache: 6 entries on disk in /home/someone")
        beside = threading.Thread(target=loader.info, args=("loading another model",))
        beside.start()
        beside.join()
        assert observability.loading == "MTP batch exactness probe: 8 of 16 widths checked (17s)"
    assert observability.loading is None
    loader.info("loaded m in 2.5s")  # the handler is gone with the load
    assert observability.loading is None
    assert not logging.getLogger("mlxcel.models.loader").filters  # the tap is gone with the load


def test_progress_is_taken_below_the_logs_level_and_not_printed() -> None:
    """``--log-level warning``: the start's INFO lines still reach ``/health``, and only its warnings the log;
    once the load ends each logger's level is its own again."""
    observability: Any = SimpleNamespace(loading=None)
    printed: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: printed.append(record.getMessage())  # type: ignore[method-assign]
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    loader = logging.getLogger("mlxcel.models.loader")
    try:
        with reported(observability):
            loader.info("loading %s: %d%% of tensors", "m", 44)
            assert observability.loading == "loading m: 44% of tensors"
            loader.warning("a warning still prints")
            logging.getLogger("mlxcel.engine.prompt_disk").info("another module's INFO line: not a step")
        assert printed == ["a warning still prints"]
        assert loader.level == logging.NOTSET and not loader.filters and loader.getEffectiveLevel() == logging.WARNING
        loader.info("after the load")
        assert observability.loading is None and printed == ["a warning still prints"]
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
