"""The disk tier's reads ahead: an entry's files summed from their bytes on the reader thread, as the worker
sums the arrays it maps, so that a hit loads a file found whole without summing it again in the worker's turn."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.engine.test_disk_writes import _caches, _tier


def test_a_files_sum_from_its_bytes_is_the_sum_of_the_arrays_mlx_maps(tmp_path: Path) -> None:
    """Every dtype the tier keeps (float32, bfloat16, a quantized layer's uint32 and its scales, a ring's
    offsets), each in a file of mlx-lm's own writing, and the arrays the layout's numbers stand for left out."""
    import mlx.core as mx
    from mlx_lm.models.cache import save_prompt_cache

    from mlxcel.engine.disk_files import checksum, file_checksum, identity
    from mlxcel.engine.disk_reads import numbers

    cache = _caches(30)
    path = tmp_path / "entry.safetensors"
    save_prompt_cache(str(path), cache, {"mlxcel_format": "2"})
    arrays, metadata = mx.load(str(path), return_metadata=True)  # type: ignore[misc]
    left_out = numbers(metadata)
    assert left_out and left_out < set(arrays)  # the ring's and the quantized layer's numbers are arrays too
    assert {array.dtype for array in arrays.values()} >= {mx.float32, mx.bfloat16, mx.uint32}
    found, read_metadata, file = file_checksum(path, numbers)
    assert found == checksum({name: array for name, array in arrays.items() if name not in left_out})
    assert found != checksum(arrays) and file_checksum(path)[0] == checksum(arrays)
    assert read_metadata == metadata and file == identity(path)


def _saved(tmp_path: Path) -> tuple[Any, list[Any], np.ndarray]:
    cache = _caches(20)
    tier = _tier(tmp_path, cache)
    tokens = np.arange(20, dtype=np.int64)
    tier.save(tokens, cache)
    tier.close()
    return _tier(tmp_path, cache), cache, tokens  # a restart: the entry is on disk only


def test_a_hit_read_ahead_loads_its_file_without_summing_it_again(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx.core as mx

    import mlxcel.engine.disk_reads as disk_reads

    tier, cache, tokens = _saved(tmp_path)
    prompt = np.arange(25, dtype=np.int64)
    assert tier.check_ahead(prompt, better_than=20) is None  # memory serves as much: nothing to read
    read = tier.check_ahead(prompt, better_than=0)
    assert read is not None and tier.check_ahead(prompt, better_than=0) is read  # one read for its arrivals
    assert read.result(timeout=60)[0] is not None
    sums: list[int] = []
    real = disk_reads.checksum
    monkeypatch.setattr(disk_reads, "checksum", lambda arrays: sums.append(1) or real(arrays))
    held, back, _ = tier.fetch(prompt, better_than=0)
    assert sums == [] and np.array_equal(held, tokens)
    for got, want in zip(back, cache[:2], strict=False):
        assert all(mx.array_equal(g, w).item() for g, w in zip(got.state, want.state, strict=True))
    assert tier.check_ahead(prompt, better_than=0) is not read  # the hit touched the file: read it anew
    tier.close()


def test_a_file_changed_after_its_read_ahead_is_summed_again_and_found_damaged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The read ahead found the file whole; then its bytes changed under its name (another inode, as a copy
    over it makes): the worker sums what it maps, and the damage is a warning and a miss, as without a read
    ahead."""
    tier, _, _ = _saved(tmp_path)
    prompt = np.arange(25, dtype=np.int64)
    read = tier.check_ahead(prompt, better_than=0)
    assert read is not None and read.result(timeout=60)[0] is not None
    (path,) = [p for p in tier.directory.glob("*.safetensors") if not p.name.endswith("drafter.safetensors")]
    data = bytearray(path.read_bytes())
    data[-64:] = bytes(64)  # the last array's last bytes zeroed under an intact header
    os.unlink(path)
    path.write_bytes(bytes(data))
    with caplog.at_level("WARNING"):
        assert tier.fetch(prompt, better_than=0) is None
    assert "checksum" in caplog.text and not path.exists()
    tier.close()


def test_a_read_ahead_that_finds_damage_leaves_the_finding_to_the_worker(tmp_path: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    tier, _, _ = _saved(tmp_path)
    (path,) = [p for p in tier.directory.glob("*.safetensors") if not p.name.endswith("drafter.safetensors")]
    data = bytearray(path.read_bytes())
    data[-64:] = bytes(64)
    path.write_bytes(bytes(data))
    prompt = np.arange(25, dtype=np.int64)
    read = tier.check_ahead(prompt, better_than=0)
    assert read is not None and read.result(timeout=60) == (None, None)
    with caplog.at_level("WARNING"):
        assert tier.fetch(prompt, better_than=0) is None
    assert "ignoring and removing" in caplog.text and "checksum" in caplog.text
    tier.close()


def test_a_file_this_tier_wrote_is_loaded_without_summing_it_again(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Its bytes were summed as they were written: once the write is done, a hit loads it as a file the read
    ahead found whole (it is not read ahead: there is nothing to wait for)."""
    import mlxcel.engine.disk_reads as disk_reads

    cache = _caches(20)
    tier = _tier(tmp_path, cache)
    tier.save(np.arange(20, dtype=np.int64), cache)
    (record,) = tier._records.values()
    assert record.pending.result(timeout=60) is not None
    tier._reap()  # what the worker's next save or fetch does first
    prompt = np.arange(25, dtype=np.int64)
    read = tier.check_ahead(prompt, better_than=0)
    assert read is not None and read.done()
    sums: list[int] = []
    real = disk_reads.checksum
    monkeypatch.setattr(disk_reads, "checksum", lambda arrays: sums.append(1) or real(arrays))
    assert tier.fetch(prompt, better_than=0) is not None and sums == []
    tier.close()


def test_a_header_whose_shape_is_not_its_bytes_is_not_found_whole(tmp_path: Path) -> None:
    """mx.load makes each array from its header's shape and dtype, so a sum over the byte ranges alone would
    pass a header damaged there."""
    from mlx_lm.models.cache import save_prompt_cache

    from mlxcel.engine.disk_files import file_checksum

    path = tmp_path / "entry.safetensors"
    save_prompt_cache(str(path), _caches(20), {"mlxcel_format": "2"})
    data = path.read_bytes()
    damaged = data.replace(b'"shape":[1,2,256,16]', b'"shape":[1,2,128,16]', 1)
    assert damaged != data
    path.write_bytes(damaged)
    with pytest.raises(ValueError, match="do not match its shape"):
        file_checksum(path)
