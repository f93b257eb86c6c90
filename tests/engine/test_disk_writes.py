"""The disk tier's files written off the worker's thread: the same files mlx-lm writes, a prompt that waits for
its entry's write, a write that fails, and the writer's bound on what waits."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest


def _caches(tokens: int) -> list[Any]:
    """One layer of each kind the disk tier keeps, holding *tokens* positions of data: a KV cache whose state
    is a slice of its buffer (not contiguous), one in bfloat16, a ring, a quantized one, and a recurrent layer
    with a slot still None."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache, RotatingKVCache

    mx.random.seed(0)
    kv, half, ring, quantized = KVCache(), KVCache(), RotatingKVCache(max_size=8), QuantizedKVCache(group_size=32)
    kv.update_and_fetch(mx.random.normal((1, 2, tokens, 16)), mx.random.normal((1, 2, tokens, 16)))
    half.update_and_fetch(*(mx.random.normal((1, 2, tokens, 16)).astype(mx.bfloat16) for _ in range(2)))
    for _ in range(tokens):
        ring.update_and_fetch(mx.random.normal((1, 2, 1, 16)), mx.random.normal((1, 2, 1, 16)))
    quantized.update_and_fetch(mx.random.normal((1, 2, tokens, 64)), mx.random.normal((1, 2, tokens, 64)))
    recurrent = ArraysCache(2)
    recurrent[1] = mx.random.normal((1, 4, 8, 8))
    return [kv, half, ring, quantized, recurrent]


def test_a_file_written_off_the_worker_is_the_file_mlx_lm_writes(tmp_path: Path) -> None:
    """The same arrays, dtypes, shapes and metadata (the checksum the worker used to compute included) as
    mlx-lm's ``save_prompt_cache`` with the old checksum, and mlx-lm's ``load_prompt_cache`` reads it back."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    from mlxcel.engine.disk_files import checksum
    from mlxcel.engine.disk_writes import cache_tensors, write

    cache = _caches(40)
    metadata = {"mlxcel_format": "2", "mlxcel_tokens": "[1,2,3]"}
    flat = tree_flatten([layer.state for layer in cache])
    sums = checksum({name: value for name, value in flat if isinstance(value, mx.array)})
    save_prompt_cache(str(tmp_path / "theirs.safetensors"), cache, {**metadata, "mlxcel_checksum": sums})
    assert write(cache_tensors(cache, metadata), tmp_path / "ours.safetensors") == sums

    theirs, their_metadata = mx.load(str(tmp_path / "theirs.safetensors"), return_metadata=True)  # type: ignore[misc]
    ours, our_metadata = mx.load(str(tmp_path / "ours.safetensors"), return_metadata=True)  # type: ignore[misc]
    assert our_metadata == their_metadata
    assert sorted(ours) == sorted(theirs)
    for name, array in theirs.items():
        assert (ours[name].dtype, ours[name].shape) == (array.dtype, array.shape), name
        assert mx.array_equal(ours[name], array).item(), name
    back = load_prompt_cache(str(tmp_path / "ours.safetensors"))
    assert [type(layer) for layer in back] == [type(layer) for layer in cache]
    for layer, kept in zip(back, cache, strict=True):
        for got, want in zip(tree_flatten(layer.state), tree_flatten(kept.state), strict=True):
            assert got[0] == want[0] and (got[1] is None) == (want[1] is None)
            if want[1] is not None:
                assert mx.array_equal(got[1], want[1]).item(), got[0]
    assert not list(tmp_path.glob(".*"))  # no temporary left behind


def _tier(root: Path, layers: list[Any]) -> Any:
    from mlx_lm.models import cache as mlx_cache

    from mlxcel.engine.prompt_disk import DiskTier

    classes = {name: c for name, c in vars(mlx_cache).items() if isinstance(c, type)}
    return DiskTier(root / "tier", 1 << 30, "model", classes, layers)


def test_a_prompt_its_entry_serves_while_it_is_written_resumes_from_its_arrays_and_a_failed_write_is_a_miss(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry is listed as soon as it is handed to the writer; a prompt it serves before the write is done
    (held here) resumes from the arrays being written, without waiting. A write that fails (here the
    entry's name is a directory) is a warning, and after it a miss; the tier goes on writing, and a restart
    reads back what was written."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import mlxcel.engine.prompt_disk as prompt_disk
    from mlxcel.engine.prompt_disk import _name

    release = threading.Event()
    real = prompt_disk.write

    def held(tensors: Any, path: Path) -> str:
        assert release.wait(60)
        return real(tensors, path)

    monkeypatch.setattr(prompt_disk, "write", held)
    cache = _caches(20)
    tier = _tier(tmp_path, cache)
    tokens = np.arange(20, dtype=np.int64)
    tier.save(tokens, cache)
    assert tier.entries == 1
    kept, back, drafter = tier.fetch(np.arange(21, dtype=np.int64), better_than=0)
    assert not list(tier.directory.glob("*.safetensors"))  # nothing written yet
    assert np.array_equal(kept, tokens) and drafter is None and len(back) == len(cache)
    for got, want in zip(back, cache, strict=True):  # a cache of its own, over the arrays being written
        assert got is not want and type(got) is type(want)
        for (name, g), (_, w) in zip(tree_flatten(got.state), tree_flatten(want.state), strict=True):
            assert (g is None and w is None) or mx.array_equal(g, w).item(), name
    release.set()

    broken = np.arange(1, 21, dtype=np.int64)
    (tier.directory / _name(broken)).mkdir()
    with caplog.at_level("WARNING"):
        tier.save(broken, cache)
        tier.save(np.arange(2, 22, dtype=np.int64), cache)
        tier.close()  # waits for the writes
    assert "could not write" in caplog.text
    assert tier.entries == 2 and len([p for p in tier.directory.glob("*.safetensors") if p.is_file()]) == 2
    restarted = _tier(tmp_path, cache)
    assert restarted.fetch(np.arange(1, 22, dtype=np.int64), better_than=0) is None
    kept, back, _ = restarted.fetch(np.arange(21, dtype=np.int64), better_than=0)
    assert np.array_equal(kept, tokens)
    assert mx.array_equal(back[0].state[0], cache[0].state[0]).item()
    restarted.close()


def test_the_writer_waits_for_the_oldest_writes_only_past_its_bound() -> None:
    from mlxcel.engine.disk_writes import Writer

    release = threading.Event()
    writer = Writer(max_pending_bytes=100)
    first = writer.submit(lambda: release.wait(60), 60)
    second = writer.submit(lambda: "second", 40)  # within the bound: handed over, the first still running
    assert not first.done() and not second.done()
    release.set()
    third = writer.submit(lambda: "third", 70)  # past it: the first two are done before this returns
    assert first.done() and second.done() and second.result() == "second"
    writer.close()
    assert third.result() == "third"
