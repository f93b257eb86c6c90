"""The exactness probes' outcomes kept for a restart (:mod:`mlxcel.engine.probe_memo`).

A second start of the same pairing, on the same machine, files and kernels, takes the outcomes the first
found instead of probing, and serves as the first did; a change to anything in the fingerprint, a bad file,
or a probe that could not run, probes again. The probes are mlxcel's own, counted as they run.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from mlxcel.engine.exactness import ProbeResult
from mlxcel.engine.probe_memo import ProbeMemo, fingerprint
from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from mlxcel.policy import HintStore, PairingKey
from tests.server.conftest import running_server

KEY = PairingKey("target", "target#mtp", "cpu-test", 3)
PRINT = {"blas": "OpenBLAS (1 thread)", "target": "abc"}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mtp_checkpoint(tmp_path_factory.mktemp("memo") / "qwen35-memo", drafter="aligned",
                                context_scale=0.05)


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """How many times each of the two probes ran (the real probes, counted)."""
    from mlxcel.engine import exactness

    calls: Counter[str] = Counter()

    def counting(name: str, real: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return real(*args, **kwargs)
        return counted

    for name in ("probe_exactness", "probe_batch_widths"):
        monkeypatch.setattr(exactness, name, counting(name, getattr(exactness, name)))
    return calls


async def _start(target: Path) -> tuple[dict[str, Any], list[str]]:
    """The policy as the server starts, and the temperature-0 texts of two requests served together.

    The batch's ``cells`` are left out of the policy: its step costs measured by an earlier start are restored
    (:meth:`~mlxcel.policy.HintStore.load_batch`), so they are there from the second start on."""
    async with running_server(["--model", str(target), "--mtp", "--draft-block-size", "3"]) as url, \
            httpx.AsyncClient(base_url=url, timeout=60) as client:
        policy = (await client.get("/v1/internal/mtp-policy")).json()
        policy["batch"].pop("cells")
        texts: dict[int, str] = {}

        async def complete(i: int) -> None:
            body = {"prompt": f"def f{i}(x):", "max_tokens": 24, "temperature": 0}
            texts[i] = (await client.post("/v1/completions", json=body)).json()["choices"][0]["text"]

        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(complete, i)
    return policy, [texts[0], texts[1]]


def _records(cache: Path) -> list[Path]:
    return sorted((cache / "mtp-policy" / "exactness").glob("*.json"))


@pytest.fixture
def cache() -> Path:
    return Path(os.environ["MLXCEL_CACHE_DIR"])  # the test's own (tests/conftest.py)


async def test_a_restart_takes_the_outcomes_and_a_rewritten_file_probes_again(
        target: Path, probes: Counter[str], cache: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxcel.models import row_exact

    first = await _start(target)
    assert probes == {"probe_exactness": 1, "probe_batch_widths": 1}
    (record,) = _records(cache)
    stored = json.loads(record.read_text())["record"]
    assert stored["burst"]["split"] is not None and stored["burst"]["detail"] is None  # exact: the burst runs
    assert stored["batch"] == {"widths": [2, 6], "declined": {}}  # --parallel 4: widths 2..5, all exact

    measured: list[int] = []

    class Measured(row_exact.RowSplit):  # what a measurement builds (a kept split is built by the memo)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            measured.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(row_exact, "RowSplit", Measured)
    with caplog.at_level(logging.INFO, logger="mlxcel"):
        second = await _start(target)
    assert probes == {"probe_exactness": 1, "probe_batch_widths": 1}  # neither ran again
    assert measured == []  # nor the row split's measurement: kept with them
    assert second == first  # the same policy as it starts, the same texts
    assert any("found at an earlier start on this machine" in r.getMessage() for r in caplog.records)
    assert any("the row split found at an earlier start" in r.getMessage() for r in caplog.records)

    status = (target / "config.json").stat()  # rewritten in place: another modification time
    os.utime(target / "config.json", ns=(status.st_atime_ns, status.st_mtime_ns + 1_000_000_000))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mlxcel"):
        third = await _start(target)
    assert probes == {"probe_exactness": 2, "probe_batch_widths": 2}
    assert third == first
    # The in-checkpoint head's files are the target's: both changed.
    assert any("probing again" in r.getMessage() and "with another drafter, target" in r.getMessage()
               for r in caplog.records)


def test_the_fingerprint_follows_the_files_and_the_settings(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    taken = fingerprint(tmp_path, tmp_path, {"kv_bits": None})
    assert fingerprint(tmp_path, tmp_path, {"kv_bits": None}) == taken
    quantized = fingerprint(tmp_path, tmp_path, {"kv_bits": 8})
    assert {k for k in taken if quantized[k] != taken[k]} == {"settings"}
    (tmp_path / "model.safetensors").write_bytes(b"0")
    assert {k for k, v in fingerprint(tmp_path, tmp_path, {"kv_bits": None}).items()
            if v != taken[k]} == {"target", "drafter"}


async def test_a_corrupt_record_warns_and_probes_again(target: Path, probes: Counter[str], cache: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    first = await _start(target)
    (record,) = _records(cache)
    record.write_bytes(b'{"version": 1, "targ')  # torn
    with caplog.at_level(logging.WARNING, logger="mlxcel"):
        again = await _start(target)
    assert again == first and probes == {"probe_exactness": 2, "probe_batch_widths": 2}
    assert any("ignoring the exactness probes' outcomes" in r.getMessage() and "not valid JSON" in r.getMessage()
               for r in caplog.records)
    assert json.loads(record.read_text())["record"]["burst"]["split"] is not None  # written whole again


async def test_a_probe_that_could_not_run_is_not_kept(target: Path, probes: Counter[str], cache: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxcel.engine import exactness

    with monkeypatch.context() as patch:
        def fails(*args: Any, **kwargs: Any) -> ProbeResult:
            raise RuntimeError("no kernel for this shape")

        patch.setattr(exactness, "probe_exactness", fails)
        vetoed, _ = await _start(target)
    assert vetoed["decline_detail"].startswith("The exactness probe could not run: RuntimeError")
    (record,) = _records(cache)  # the row split measured before it is kept; no outcome: the next start probes
    assert json.loads(record.read_text())["record"]["burst"] is None
    restarted, _ = await _start(target)
    assert restarted["decline_detail"] is None and probes["probe_exactness"] == 1


async def test_a_kept_rows_split_is_measured_where_no_step_measured_it(
        target: Path, probes: Counter[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Off the CPU only the burst's probe measures the row split (a step of several rows is not made to agree
    there): a start that takes the kept ``rows`` outcome must measure it still, or its verify multiplies whole
    what the probe found exact only in chunks. The CPU's step measurement taken out stands in for a GPU; every
    ``rows`` verify notes whether its model's products were measured."""
    from mlxcel.models import row_exact

    monkeypatch.setattr(row_exact, "measure_steps", lambda *args, **kwargs: None)
    measured: list[bool] = []
    apart = row_exact.rows_apart

    def noted(model: Any, batch: bool = False) -> Any:
        measured.append(getattr(model, "row_split", None) is not None)
        return apart(model, batch)

    monkeypatch.setattr(row_exact, "rows_apart", noted)
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "1")
    for start in ("probed", "kept"):
        measured.clear()
        async with running_server(["--model", str(target), "--mtp", "--draft-block-size", "4", "--parallel", "1"]
                                  ) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
            body = (await client.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 24,
                                                               "temperature": 0})).json()
        assert body["timings"]["draft_rounds"] > 0, start
        assert measured and all(measured), start  # the probe's verifies too, on the first start
    assert probes["probe_exactness"] == 1


def test_the_batch_outcome_is_kept_for_its_widths_and_a_new_burst_outcome_drops_it(tmp_path: Path) -> None:
    hints = HintStore(tmp_path, {"mlx": "1"})
    memo = ProbeMemo(hints, KEY, PRINT)
    assert (memo.burst(), memo.batch(range(2, 6))) == (None, None)  # nothing stored
    memo.save_burst(ProbeResult("rows", None))
    memo.save_batch(range(2, 6), {4: "width 4 differs at position 1"})
    again = ProbeMemo(hints, KEY, PRINT)
    assert again.burst() == ProbeResult("rows", None)
    assert again.batch(range(2, 6)) == {4: "width 4 differs at position 1"}
    assert again.batch(range(2, 10)) is None  # other widths (--parallel): probed
    assert ProbeMemo(hints, KEY, {**PRINT, "blas": "Intel MKL"}).burst() is None  # another fingerprint
    assert ProbeMemo(HintStore(tmp_path, {"mlx": "2"}), KEY, PRINT).burst() is None  # other kernels
    again.save_burst(ProbeResult(None, "With one K-wide verify forward, ..."))
    vetoed = ProbeMemo(hints, KEY, PRINT)
    assert vetoed.burst() == ProbeResult(None, "With one K-wide verify forward, ...")
    assert vetoed.batch(range(2, 6)) is None  # measured after the burst's outcome it followed


SPLIT = {"chunks": [[64, 32, 3]], "pads": [[64, 32, 2]], "tiles": [[32, 64, 12, 6]], "batch_shapes": [], "share": 0.25,
         "max_rows": 4, "max_batch": 5, "steps": True}


@pytest.mark.parametrize("record", [
    {"fingerprint": PRINT, "split": None, "burst": {"split": "diagonal", "detail": None}, "batch": None},
    {"fingerprint": PRINT, "split": None, "burst": {"split": "rows", "detail": "both"}, "batch": None},
    {"fingerprint": PRINT, "split": None, "burst": None, "batch": {"widths": [2], "declined": {}}},
    {"fingerprint": PRINT, "split": None, "burst": None, "batch": {"widths": [2, 6], "declined": {"four": "x"}}},
    {"fingerprint": PRINT, "split": None, "burst": None},
    {"fingerprint": PRINT, "split": None, "burst": {"split": ["rows"], "detail": None}, "batch": None},
    {"fingerprint": PRINT, "split": None, "burst": None, "batch": {"widths": [2, 6], "declined": {"²": "x"}}},
    {"fingerprint": PRINT, "burst": None, "batch": None},
    {"fingerprint": PRINT, "split": {**SPLIT, "chunks": [[64, 32]]}, "burst": None, "batch": None},
    {"fingerprint": PRINT, "split": {**SPLIT, "steps": 1}, "burst": None, "batch": None},
    {"fingerprint": PRINT, "split": {**SPLIT, "pads": [[64, 32, 0]]}, "burst": None, "batch": None},
    {"fingerprint": PRINT, "split": {k: v for k, v in SPLIT.items() if k != "tiles"}, "burst": None, "batch": None},
], ids=["unknown-split", "split-and-veto", "one-width", "named-width", "no-batch-field", "split-a-list",
        "a-digit-not-ascii", "no-row-split-field", "a-chunk-without-its-rows", "steps-not-a-bool", "no-rows",
        "no-tiles-field"])
def test_a_malformed_record_is_ignored_with_a_warning(tmp_path: Path, record: dict[str, Any],
                                                      caplog: pytest.LogCaptureFixture) -> None:
    hints = HintStore(tmp_path, {})
    hints.save_probe(KEY, record)
    with caplog.at_level(logging.WARNING, logger="mlxcel"):
        memo = ProbeMemo(hints, KEY, PRINT)
    assert (memo.burst(), memo.batch(range(2, 6)), memo.split(4, 5)) == (None, None, None)
    assert [r.getMessage() for r in caplog.records if "probing again" in r.getMessage()]


def test_the_row_split_is_kept_for_its_bounds_and_a_new_one_drops_the_outcomes_measured_after_it(
        tmp_path: Path) -> None:
    from mlxcel.models.row_exact import RowSplit

    hints = HintStore(tmp_path, {"mlx": "1"})
    memo = ProbeMemo(hints, KEY, PRINT)
    assert memo.split(4, 5) is None
    measured = RowSplit({(64, 32): 3, (128, 64): 1}, 0.25, 4, 5, True, frozenset({(32, 64)}), {(64, 32): 2})
    memo.save_split(measured)
    memo.save_burst(ProbeResult("rows", None))
    again = ProbeMemo(hints, KEY, PRINT)
    kept = again.split(4, 5)
    assert kept is not None and again.burst() == ProbeResult("rows", None)
    assert (kept.chunks, kept.pads, kept.batch_shapes, kept.share, kept.max_rows, kept.max_batch, kept.steps) == \
        ({(64, 32): 3, (128, 64): 1}, {(64, 32): 2}, frozenset({(32, 64)}), 0.25, 4, 5, True)
    assert again.split(4, 9) is None and again.split(3, 5) is None  # other bounds (--parallel, K): measured
    again.save_split(measured)  # measured again: what was probed after the last measurement goes
    assert ProbeMemo(hints, KEY, PRINT).burst() is None
