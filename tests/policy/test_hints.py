"""The persisted hint: atomic, versioned, strictly validated, and never fatal."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
from pathlib import Path

import pytest

from mlxcel.policy import HINT_VERSION, Hint, HintStore, PairingKey


def _hint(key: PairingKey, verdict: str = "enable", rate: float = 0.62) -> Hint:
    return Hint(key=key, verdict=verdict, acceptance_rate=rate, samples=4,  # type: ignore[arg-type]
                estimated_speedup=1.7)


def test_path_is_the_documented_key_hash(hints: HintStore, cache_root: Path, pairing: PairingKey) -> None:
    import hashlib

    digest = hashlib.sha256(b"Gemma4-12B|Gemma4-12B-MTP|M5-16c|K4").hexdigest()[:16]
    assert hints.path_for(pairing) == cache_root / "mtp-policy" / f"{digest}.json"


def test_round_trip(hints: HintStore, pairing: PairingKey) -> None:
    assert hints.load(pairing) is None
    written = hints.save(_hint(pairing))
    assert written == hints.path_for(pairing)
    assert hints.load(pairing) == _hint(pairing)
    # No temporary files are left beside the hint.
    assert [p.name for p in written.parent.iterdir()] == [written.name]


def _corrupt_cases(key: PairingKey) -> dict[str, bytes]:
    good = _hint(key).to_json({})
    return {
        "truncated": json.dumps(good).encode()[:40],
        "not json": b"\x00\xff garbage",
        "not an object": b"[1, 2, 3]",
        "wrong version": json.dumps({**good, "version": HINT_VERSION + 1}).encode(),
        "no version": json.dumps({k: v for k, v in good.items() if k != "version"}).encode(),
        "wrong target": json.dumps({**good, "target": "other"}).encode(),
        "wrong hardware": json.dumps({**good, "hardware": "M4-10c"}).encode(),
        "wrong block size": json.dumps({**good, "block_size": 3}).encode(),
        "float block size": json.dumps({**good, "block_size": 4.0}).encode(),
        "bad verdict": json.dumps({**good, "verdict": "maybe"}).encode(),
        "rate above one": json.dumps({**good, "acceptance_rate": 1.5}).encode(),
        "rate is text": json.dumps({**good, "acceptance_rate": "0.6"}).encode(),
        "samples zero": json.dumps({**good, "samples": 0}).encode(),
        "samples bool": json.dumps({**good, "samples": True}).encode(),
        "extra field": json.dumps({**good, "prompt": "secret"}).encode(),
        "no kernels": json.dumps({k: v for k, v in good.items() if k != "kernels"}).encode(),
        "kernels a list": json.dumps({**good, "kernels": ["mlx"]}).encode(),
        "kernel version a number": json.dumps({**good, "kernels": {"mlx": 0.3}}).encode(),
        "other kernels": json.dumps({**good, "kernels": {"mlx": "0.1.0"}}).encode(),
        "no depth limit": json.dumps({k: v for k, v in good.items() if k != "depth_limit"}).encode(),
        "depth limit zero": json.dumps({**good, "depth_limit": 0}).encode(),
        "depth limit a float": json.dumps({**good, "depth_limit": 4096.0}).encode(),
        "depth limit a bool": json.dumps({**good, "depth_limit": True}).encode(),
        "huge": b" " * (1024 * 1024),
    }


@pytest.mark.parametrize("case", list(_corrupt_cases(PairingKey("t", "d", "h", 4))))
def test_bad_files_are_ignored_with_one_warning(hints: HintStore, case: str,
                                                caplog: pytest.LogCaptureFixture) -> None:
    key = PairingKey("t", "d", "h", 4)
    path = hints.path_for(key)
    path.parent.mkdir(parents=True)
    path.write_bytes(_corrupt_cases(key)[case])
    with caplog.at_level(logging.WARNING):
        assert hints.load(key) is None
        assert hints.load(key) is None
    assert len(caplog.records) == 1
    assert str(path) in caplog.records[0].getMessage()
    # Re-profiling then overwrites the bad file with a good one.
    hints.save(_hint(key))
    assert hints.load(key) == _hint(key)


def test_a_verdict_measured_under_other_kernels_is_profiled_again(
        cache_root: Path, pairing: PairingKey, caplog: pytest.LogCaptureFixture) -> None:
    old = HintStore(cache_root, {"mlx": "0.31.0", "mlx-lm": "0.31.1"})
    old.save(_hint(pairing))
    assert old.load(pairing) == _hint(pairing)
    assert json.loads(old.path_for(pairing).read_text())["kernels"] == {"mlx": "0.31.0", "mlx-lm": "0.31.1"}
    new = HintStore(cache_root, {"mlx": "0.32.4", "mlx-lm": "0.31.1"})
    with caplog.at_level(logging.WARNING):
        assert new.load(pairing) is None
    assert caplog.records[0].getMessage() == (
        f"ignoring the MTP policy hint {new.path_for(pairing)}: it was measured under mlx 0.31.0, "
        "mlx-lm 0.31.1 and this server runs mlx 0.32.4, mlx-lm 0.31.1; profiling the pairing again")
    # The new verdict replaces it, under the running kernels.
    new.save(_hint(pairing, verdict="decline"))
    assert new.load(pairing) == _hint(pairing, verdict="decline")
    assert old.load(pairing) is None


def test_foreign_key_in_our_file_name_is_ignored(hints: HintStore, pairing: PairingKey) -> None:
    other = PairingKey("x", "y", "z", 2)
    hints.save(_hint(other))
    os.replace(hints.path_for(other), hints.path_for(pairing))
    assert hints.load(pairing) is None


def test_unwritable_directory_warns_once_and_returns_none(tmp_path: Path, pairing: PairingKey,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = HintStore(blocker)
    with caplog.at_level(logging.WARNING):
        assert store.save(_hint(pairing)) is None
        assert store.save(_hint(pairing)) is None
    assert len(caplog.records) == 1


def _writer(root: str, verdict: str, rounds: int) -> None:
    store = HintStore(Path(root))
    key = PairingKey("t", "d", "h", 4)
    for i in range(rounds):
        store.save(_hint(key, verdict=verdict, rate=round((i % 100) / 100, 2)))


@pytest.mark.slow
def test_concurrent_writers_never_leave_a_torn_file(cache_root: Path) -> None:
    key = PairingKey("t", "d", "h", 4)
    store = HintStore(cache_root)
    store.save(_hint(key))
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_writer, args=(str(cache_root), verdict, 300))
               for verdict in ("enable", "decline", "enable")]
    for process in writers:
        process.start()
    reads = 0
    while any(p.is_alive() for p in writers) or reads < 50:
        reader = HintStore(cache_root)  # fresh store: no warn-once memory
        assert reader.load(key) is not None, "a reader saw a missing or torn hint"
        reads += 1
    for process in writers:
        process.join(timeout=60)
        assert process.exitcode == 0
    assert [p.name for p in store.directory.iterdir()] == [store.path_for(key).name]


TABLE = {"max_drafts": 3, "cells": [{"width": 2, "band": 0, "seconds": {"0": 0.02, "3": 0.03}}]}


def test_the_batch_s_step_costs_sit_beside_the_hint(cache_root: Path, pairing: PairingKey,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    store = HintStore(cache_root, {"mlx": "0.32.4"})
    assert store.load_batch(pairing) is None
    path = store.save_batch(pairing, TABLE)
    assert path == store.batch_path_for(pairing) and path.parent == store.path_for(pairing).parent
    assert store.load_batch(pairing) == TABLE
    assert store.load(pairing) is None  # its own file: no verdict is implied
    # Another pairing's, other kernels', a corrupt or foreign file: ignored, each with one warning.
    assert store.load_batch(PairingKey("x", "y", "z", 2)) is None
    with caplog.at_level(logging.WARNING):
        assert HintStore(cache_root, {"mlx": "0.33.0"}).load_batch(pairing) is None
        for raw in (b"{", b"[]", json.dumps({"version": 9}).encode(),
                    json.dumps({**json.loads(path.read_text()), "extra": 1}).encode()):
            path.write_bytes(raw)
            assert store.load_batch(pairing) is None
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records] == [
        "it was measured under mlx 0.32.4 and this server runs mlx 0.33.0; measuring them again",
        "it is not valid JSON (corrupt or truncated)", "it is not a JSON object",
        "its version is 9, this server writes 1", "its fields are not those of the batch's step costs"]
    os.unlink(path)
    os.mkfifo(path)  # never blocks the worker
    assert store.load_batch(pairing) is None
