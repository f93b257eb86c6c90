"""The disk tier's edges: prompts kept private, damage under an intact header found, a FIFO skipped, the tier
shown from the start, and one process per model directory.

Each test has a cache directory of its own (``MLXCEL_CACHE_DIR``, tests/conftest.py).
"""

from __future__ import annotations

import logging
import os
import random
import stat
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.server.conftest import running_server
from tests.server.test_prompt_cache_disk import CONVERSATION, NEXT, _ask, _files


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _tier() -> Path:
    return Path(os.environ["MLXCEL_CACHE_DIR"]) / "prompt-cache"


async def _kept(model: Path) -> list[Path]:
    """The tier's files once a server has served the conversation and stopped (it writes what it holds)."""
    async with running_server(["--model", str(model)]) as url:
        await _ask(url, CONVERSATION)
    return _files()


async def test_kept_prompts_are_readable_by_their_owner_only_and_an_open_directory_is_closed(
        cache_models: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    model = cache_models["qwen3_5"]
    _tier().mkdir(parents=True, mode=0o755)
    os.chmod(_tier(), 0o755)  # as an older mlxcel (or a umask of 022) left it
    with caplog.at_level(logging.WARNING, logger="mlxcel.engine.disk_files"):
        async with running_server(["--model", str(model)]) as url:
            await _ask(url, CONVERSATION)
    files = _files()
    assert files and {_mode(path) for path in files} == {0o600}
    assert _mode(_tier()) == 0o700 and {_mode(path.parent) for path in files} == {0o700}
    assert any("open to other users" in r.getMessage() for r in caplog.records)


def _scale_every_float(path: Path) -> None:
    """Every floating array in *path* doubled, its header (tokens, checksum, everything) kept as it was."""
    import mlx.core as mx

    arrays, metadata = mx.load(str(path), return_metadata=True)
    scaled = {k: v * 2 if mx.issubdtype(v.dtype, mx.floating) else v for k, v in arrays.items()}
    mx.save_safetensors(str(path), scaled, metadata)


def _randomise_a_quarter(path: Path) -> None:
    """A quarter of the bytes after the header replaced by noise."""
    data = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    length = (len(data) - start) // 4
    data[start:start + length] = random.Random(0).randbytes(length)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_scale_every_float, _randomise_a_quarter])
async def test_data_damaged_under_an_intact_header_is_a_warning_and_a_miss(
        cache_models: dict[str, Path], caplog: pytest.LogCaptureFixture, damage: Any) -> None:
    model = cache_models["qwen3_5"]
    for path in await _kept(model):
        damage(path)
    with caplog.at_level(logging.WARNING, logger="mlxcel.engine.prompt_disk"):
        async with running_server(["--model", str(model)]) as url:
            answer = await _ask(url, NEXT)
    async with running_server(["--model", str(model), "--prompt-cache-size", "0"]) as url:
        cold = await _ask(url, NEXT)
    assert answer["stats"]["disk"]["hits"] == 0 and answer["timings"]["cached_n"] == 0
    assert answer["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    assert any("checksum" in r.getMessage() for r in caplog.records)


async def test_a_fifo_named_like_an_entry_is_skipped_and_the_tier_is_shown_before_any_request(
        cache_models: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    model = cache_models["qwen3_5"]
    kept = await _kept(model)
    os.mkfifo(kept[0].parent / ("f" * 64 + ".safetensors"))
    with caplog.at_level(logging.WARNING, logger="mlxcel.engine.prompt_disk"), trio.fail_after(60):
        async with running_server(["--model", str(model), "--metrics"]) as url, \
                httpx.AsyncClient(base_url=url, timeout=30) as client:
            stats = (await client.get("/v1/cache/stats")).json()["disk"]
            metrics = (await client.get("/metrics")).text
    assert stats["entries"] == len(kept) and stats["bytes"] > 0 and stats["max_bytes"] > 0
    assert f"mlxcel_prefix_cache_disk_entries {float(len(kept))}" in metrics
    assert any("not a regular file" in r.getMessage() for r in caplog.records)


async def test_a_second_server_on_the_same_directory_runs_without_the_tier_and_deletes_nothing(
        cache_models: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    model = cache_models["qwen3_5"]
    kept = await _kept(model)
    with caplog.at_level(logging.WARNING, logger="mlxcel.engine.prompt_disk"):
        async with running_server(["--model", str(model)]) as first, \
                running_server(["--model", str(model), "--prompt-cache-disk-bytes", "1"]) as second:
            owner = (await _ask(first, NEXT))["stats"]["disk"]
            other = (await _ask(second, NEXT))["stats"]["disk"]
    assert owner["hits"] == 1 and other == {**other, "entries": 0, "max_bytes": 0, "hits": 0}
    assert set(kept) <= set(_files()), "the second server removed none of the first one's files"
    assert any("another mlxcel process uses" in r.getMessage() for r in caplog.records)
    async with running_server(["--model", str(model)]) as url:  # the lock went with the servers
        assert (await _ask(url, NEXT))["stats"]["disk"]["max_bytes"] > 0
