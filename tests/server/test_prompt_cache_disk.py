"""The prefix cache's disk tier: an agent's conversation resumes after a restart, and damaged files cost a miss.

Each test has a cache directory of its own (``MLXCEL_CACHE_DIR``, tests/conftest.py); a server that stops
writes what its prefix cache holds there, and the next server on the same model reads it back on a hit. The
first server's root, the same for every test on a model, is made once a module and each test starts from a copy
(:func:`written`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.server.conftest import running_server
from tests.server.test_prompt_cache import SYSTEM, _length

CONVERSATION = [SYSTEM, {"role": "user", "content": "Fix the bug in main.py"}]
NEXT = [*CONVERSATION, {"role": "assistant", "content": "Looking at it."},
        {"role": "user", "content": "Tool result: " + "ok " * 15}]


async def _ask(url: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        answer: dict[str, Any] = (await client.post("/v1/chat/completions", json={
            "messages": messages, "max_tokens": 8, "temperature": 0})).json()
        answer["stats"] = (await client.get("/v1/cache/stats")).json()
    return answer


@pytest.fixture(scope="module")
def colds() -> dict[Path, dict[str, Any]]:
    """Each model's answer to NEXT from a server without a prompt cache, by model, as :func:`_cold` asked it: the
    same for every test (that server reads and writes no cache), so asked once a module."""
    return {}


async def _cold(model: Path, colds: dict[Path, dict[str, Any]]) -> dict[str, Any]:
    if model not in colds:
        async with running_server(["--model", str(model), "--prompt-cache-size", "0"]) as url:
            colds[model] = await _ask(url, NEXT)
    return colds[model]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path], Awaitable[Path]]:
    """The cache root a server on a model leaves once it answered CONVERSATION and stopped (its prompt caches
    written), by model: the same for every test, so made once a module, in a root of its own that no server reads
    (each test resumes from a copy, :func:`_after_a_stop`)."""
    roots: dict[Path, Path] = {}

    async def root(model: Path) -> Path:
        if model not in roots:
            where = tmp_path_factory.mktemp("written")
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("MLXCEL_CACHE_DIR", str(where))
                async with running_server(["--model", str(model)]) as url:
                    await _ask(url, CONVERSATION)
            roots[model] = where
        return roots[model]

    return root


async def _after_a_stop(model: Path, written: Callable[[Path], Awaitable[Path]]) -> None:
    """This test's cache root as a server on *model* leaves it that answered CONVERSATION and stopped."""
    shutil.copytree(await written(model), os.environ["MLXCEL_CACHE_DIR"], dirs_exist_ok=True)


def _files() -> list[Path]:
    return sorted((Path(os.environ["MLXCEL_CACHE_DIR"]) / "prompt-cache").glob("*/*.safetensors"))


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma4", "inkling"])
async def test_a_conversation_resumes_after_a_restart_as_it_would_have_without_one(
        cache_models: dict[str, Path], colds: dict[Path, dict[str, Any]],
        written: Callable[[Path], Awaitable[Path]], family: str) -> None:
    model = cache_models[family]
    await _after_a_stop(model, written)
    assert _files(), "the stopping server wrote its prompt caches"
    async with running_server(["--model", str(model)]) as url:
        resumed = await _ask(url, NEXT)
    cold = await _cold(model, colds)
    assert resumed["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    assert resumed["timings"]["cached_n"] >= _length(model, CONVERSATION) - 1
    assert resumed["stats"]["disk"]["hits"] == 1 and cold["timings"]["cached_n"] == 0


async def test_damaged_and_foreign_files_are_a_warning_and_a_miss(
        cache_models: dict[str, Path], colds: dict[Path, dict[str, Any]],
        written: Callable[[Path], Awaitable[Path]], caplog: pytest.LogCaptureFixture) -> None:
    model = cache_models["qwen3_5"]
    await _after_a_stop(model, written)
    files = _files()
    directory = files[0].parent
    for path in files:  # every file of ours cut short, as a crash mid-copy would leave it
        path.write_bytes(path.read_bytes()[:200])
    (directory / ("0" * 64 + ".safetensors")).write_bytes(b"not a safetensors file")
    foreign = directory.parent / "another-model" / "f.safetensors"
    foreign.parent.mkdir()
    foreign.write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with caplog.at_level(logging.WARNING, logger="mlxcel.engine.prompt_disk"):
        async with running_server(["--model", str(model)]) as url:
            answer = await _ask(url, NEXT)
    cold = await _cold(model, colds)
    assert answer["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    assert answer["timings"]["cached_n"] == 0 and answer["stats"]["disk"]["hits"] == 0
    assert sum("ignoring and removing" in r.getMessage() for r in caplog.records) == len(files) + 1
    assert foreign.exists()  # another model's directory is not this server's to clean


async def test_the_disk_tier_is_bounded_and_an_unwritable_directory_turns_it_off(
        cache_models: dict[str, Path], written: Callable[[Path], Awaitable[Path]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    model = cache_models["qwen3_5"]
    await _after_a_stop(model, written)
    largest = max(path.stat().st_size for path in _files())
    for path in _files():
        path.unlink()
    async with running_server(["--model", str(model), "--prompt-cache-disk-bytes", str(largest)]) as url:
        answer = await _ask(url, CONVERSATION)
    assert answer["stats"]["disk"]["max_bytes"] == largest
    assert len(_files()) >= 1 and sum(path.stat().st_size for path in _files()) <= largest
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache directory would be")
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(blocked))
    with caplog.at_level(logging.WARNING, logger="mlxcel.engine.prompt_disk"):
        async with running_server(["--model", str(model)]) as url:
            answer = await _ask(url, CONVERSATION)
    assert answer["choices"][0]["message"]["content"] is not None
    assert any("no disk tier" in r.getMessage() for r in caplog.records)


async def test_after_a_restart_the_drafter_resumes_where_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """The MTP drafter's state is written beside the snapshot it went with: a prompt resumed from disk drafts
    as a prefilled one does (the same drafts as without a cache), and the text is classic decode's. (The
    state's round trip itself, byte for byte: tests/engine/test_prefix_cache.py.)"""
    from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint

    model = build_mtp_checkpoint(tmp_path / "qwen35-partial", drafter="aligned", context_scale=0.05)
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "1")

    async def ask(*argv: str) -> dict[str, Any]:
        async with running_server(["--model", str(model), "--mtp", *argv]) as url, \
                httpx.AsyncClient(base_url=url, timeout=120) as client:
            answer: dict[str, Any] = (await client.post("/v1/chat/completions", json={
                "messages": NEXT, "max_tokens": 24, "temperature": 0})).json()
        return answer

    async with running_server(["--model", str(model), "--mtp"]) as url:
        await _ask(url, CONVERSATION)
    root = Path(os.environ["MLXCEL_CACHE_DIR"])
    assert list(root.glob("prompt-cache/*/*.drafter.safetensors")), "the stopping server wrote the drafter's states"
    resumed = await ask()
    cold = await ask("--prompt-cache-size", "0")
    assert resumed["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    assert resumed["timings"]["cached_n"] > 0
    assert (resumed["timings"]["draft_n"], resumed["timings"]["draft_n_accepted"]) == \
        (cold["timings"]["draft_n"], cold["timings"]["draft_n_accepted"])


async def test_a_stream_goes_on_while_another_prompts_entry_is_read_from_disk(
        cache_models: dict[str, Path], written: Callable[[Path], Awaitable[Path]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An entry on disk is read and checked off the worker's turn: here its read is held until a stream
    beside it has taken ten more tokens, and the arrival it serves waits meanwhile, then resumes from it."""
    from tokenizers import Tokenizer

    import mlxcel.engine.prompt_disk as prompt_disk

    model = cache_models["qwen3_5"]
    await _after_a_stop(model, written)
    reading, release = threading.Event(), threading.Event()
    real = prompt_disk.checked

    def held(*args: Any) -> Any:
        reading.set()
        release.wait(60)
        return real(*args)

    monkeypatch.setattr(prompt_disk, "checked", held)
    eos = json.loads((model / "tokenizer_config.json").read_text())["eos_token"]
    stream_body = {"prompt": "Counting:", "max_tokens": 200, "temperature": 0, "stream": True,
                   "logit_bias": {str(Tokenizer.from_file(str(model / "tokenizer.json")).token_to_id(eos)): -100}}
    resumed: dict[str, Any] = {}

    async def ask_next(url: str) -> None:
        resumed.update(await _ask(url, NEXT))

    async with running_server(["--model", str(model), "--metrics"]) as url, \
            httpx.AsyncClient(base_url=url, timeout=120) as client, \
            client.stream("POST", "/v1/completions", json=stream_body) as stream:
        lines = aiter(stream.aiter_lines())
        while not (await anext(lines)).startswith("data: {"):
            pass  # the stream is decoding
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask_next, url)
            assert await trio.to_thread.run_sync(reading.wait, 60)
            meanwhile = 0
            while meanwhile < 10:
                meanwhile += (await anext(lines)).startswith("data: {")
            assert not resumed  # still waiting for its entry, and counted as waiting
            assert "\nmlxcel_queue_depth 1.0\n" in (await client.get("/metrics")).text
            release.set()
        async for _ in lines:
            pass
    assert resumed["stats"]["disk"]["hits"] == 1
    assert resumed["timings"]["cached_n"] >= _length(model, CONVERSATION) - 1
