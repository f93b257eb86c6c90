"""The prefix cache as agents use it: every turn resends the conversation, one tool result longer.

For each kind of per-sequence state the served families have (a llama's KV
cache, which rewinds; Qwen 3.5's gated-delta recurrence, Gemma 4's sliding
window ring and Inkling's convolutions, which do not), each turn must resume
from the previous turn's prompt, and answer exactly what a server without a
prefix cache answers. Expected reuse is computed from transformers' own
rendering and tokenizing of the conversation, independently of mlxcel.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxcel.testing.base import THINKING_CHATML
from mlxcel.testing.checkpoints import build_checkpoint
from tests.server.conftest import anthropic_client, running_server

SYSTEM = {"role": "system", "content": "You are a coding agent working in a repository. " * 12}
FIRST = "Fix the bug in main.py"

Answers = dict[str, list[dict[str, Any]]]
"""An agent's turns (:func:`_agent`'s answers) by the first message of its session."""


async def _agent(url: str, turns: int, first: str = FIRST, max_tokens: int = 8
                 ) -> list[dict[str, Any]]:
    """An agent loop: each turn appends the reply and a tool result, and resends everything."""
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": first}]
    answers = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for turn in range(turns):
            answer = (await client.post("/v1/chat/completions", json={
                "messages": messages, "max_tokens": max_tokens, "temperature": 0})).json()
            answers.append({**answer, "messages": list(messages)})
            messages += [{"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"Tool result {turn}: " + "ok " * 15}]
    return answers


@pytest.fixture(scope="module")
def without_the_cache(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Path, Sequence[str]], Awaitable[Answers]]:
    """The turns (4) a server without a prefix cache answers an agent whose session starts with each of *firsts*:
    what a cached run must answer. Each model's from a server of a cache root of its own, each session once a
    module (two tests compare with the same one)."""
    answers: dict[tuple[Path, str], list[dict[str, Any]]] = {}

    async def without(model: Path, firsts: Sequence[str]) -> Answers:
        if missing := [first for first in firsts if (model, first) not in answers]:
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("MLXCEL_CACHE_DIR", str(tmp_path_factory.mktemp("without-the-cache")))
                async with running_server(["--model", str(model), "--prompt-cache-size", "0"]) as url:
                    for first in missing:
                        answers[model, first] = await _agent(url, 4, first)
        return {first: answers[model, first] for first in firsts}

    return without


@functools.cache
def _tokenizer(checkpoint: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint)


def _length(checkpoint: Path, messages: list[dict[str, Any]], generation: bool = True) -> int:
    tokenizer = _tokenizer(checkpoint)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma4", "inkling"])
async def test_each_turn_resumes_from_the_last_prompt_and_answers_as_without_the_cache(
        cache_models: dict[str, Path], family: str,
        without_the_cache: Callable[[Path, Sequence[str]], Awaitable[Answers]]) -> None:
    model = cache_models[family]
    async with running_server(["--model", str(model)]) as url:
        warm = await _agent(url, 4)
        async with httpx.AsyncClient(base_url=url) as client:
            stats = (await client.get("/v1/cache/stats")).json()
    cold = (await without_the_cache(model, [FIRST]))[FIRST]
    assert [a["choices"][0]["message"]["content"] for a in warm] == \
        [a["choices"][0]["message"]["content"] for a in cold]
    for earlier, answer in itertools.pairwise(warm):
        cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == answer["timings"]["cached_n"]  # the prompt tokens not prefilled
        assert cached >= earlier["usage"]["prompt_tokens"] - 1, (family, cached)
        assert answer["usage"]["prompt_tokens"] == _length(model, answer["messages"])
    assert warm[0]["timings"]["cached_n"] == 0 and all(a["timings"]["cached_n"] == 0 for a in cold)
    # Only a cache that cannot be rewound needs snapshots: at the end of the system prompt (the first turn's
    # prefill passes it; the later ones resume beyond it), and in every turn at the end of the conversation
    # before the generation prompt and at the end of the prompt.
    assert stats["snapshots"] == (0 if family == "llama" else 1 + 2 * 4), stats


@pytest.mark.parametrize("family", ["qwen3_5", "gemma4"])
async def test_agents_at_once_each_resume_from_their_own_last_prompt(
        cache_models: dict[str, Path], family: str,
        without_the_cache: Callable[[Path, Sequence[str]], Awaitable[Answers]]) -> None:
    """Three agents interleaved on one server: their prompts are prefilled together in the continuous batch,
    which keeps the snapshots a solo prefill keeps, so every session resumes from its own last prompt."""
    import trio

    model = cache_models[family]
    firsts = [FIRST, "Write the tests for util.py", "Explain the build"]
    together: dict[str, list[dict[str, Any]]] = {}

    async def session(url: str, first: str) -> None:
        together[first] = await _agent(url, 4, first)

    # The sessions meet in the batch: the scheduler puts any request beside another sequence there, handed
    # over from solo decode or, when they reach the worker in one drain, admitted there (no counter tells
    # which; it is timing: a fast run had no handoff at all). Its rules are tests/engine/test_scheduler.py's.
    async with running_server(["--model", str(model)]) as url:
        async with trio.open_nursery() as nursery:
            for first in firsts:
                nursery.start_soon(session, url, first)
        async with httpx.AsyncClient(base_url=url) as client:
            stats = (await client.get("/v1/cache/stats")).json()
    alone = await without_the_cache(model, firsts)
    for first in firsts:
        assert [a["choices"][0]["message"]["content"] for a in together[first]] == \
            [a["choices"][0]["message"]["content"] for a in alone[first]]
        for earlier, answer in itertools.pairwise(together[first]):
            assert answer["timings"]["cached_n"] >= earlier["usage"]["prompt_tokens"] - 1, (first, answer["timings"])
    # Every turn keeps two of its own; a first turn also keeps the end of the system prompt unless another
    # session's snapshot served it.
    assert 2 * 4 * len(firsts) < stats["snapshots"] <= (1 + 2 * 4) * len(firsts), stats


async def test_a_thinking_template_resumes_from_before_its_open_think_block(tmp_path: Path) -> None:
    """The prompt ends in an open <think> block that the next turn renders otherwise: the snapshot that serves
    it is the one at the end of the conversation before the generation prompt."""
    model = build_checkpoint(tmp_path / "thinker", "qwen3_5", scale=2.0, chat_template=THINKING_CHATML,
                             markers=("<think>", "</think>"))
    async with running_server(["--model", str(model)]) as url:
        first, second = await _agent(url, 2)
    assert _length(model, first["messages"]) > _length(model, first["messages"], generation=False)
    assert second["timings"]["cached_n"] == _length(model, first["messages"], generation=False)


async def test_a_new_conversation_resumes_from_the_shared_system_prompt(cache_models: dict[str, Path]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    model = cache_models["qwen3_5"]
    async with running_server(["--model", str(model), "--metrics"]) as url:
        await _agent(url, 1)
        (other,) = await _agent(url, 1, first="Write the tests for util.py")
        async with httpx.AsyncClient(base_url=url) as client:
            stats = (await client.get("/v1/cache/stats")).json()
            metrics = {s.name: s.value for f in text_string_to_metric_families((await client.get("/metrics")).text)
                       for s in f.samples}
    assert other["timings"]["cached_n"] == _length(model, [SYSTEM], generation=False)
    # /metrics says what /v1/cache/stats says.
    assert (stats["lookups"], stats["hits"]) == (2, 1)
    for name in ("lookups", "hits", "reused_tokens", "snapshots", "evictions"):
        assert metrics[f"mlxcel_prefix_cache_{name}_total"] == stats[name], name
    assert (metrics["mlxcel_prefix_cache_entries"], metrics["mlxcel_prefix_cache_bytes"]) == \
        (stats["entries"], stats["bytes"])


async def test_messages_report_the_snapshot_hit_as_cache_reads(cache_models: dict[str, Path]) -> None:
    import trio

    def session(url: str) -> list[Any]:
        with anthropic_client(url) as client:
            ask: Any = [{"role": "user", "content": "Fix the bug"}]
            first = client.messages.create(model="default", max_tokens=4, system=SYSTEM["content"], messages=ask)
            again: Any = [*ask, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks"}]
            return [first, client.messages.create(model="default", max_tokens=4, system=SYSTEM["content"],
                                                  messages=again)]

    async with running_server(["--model", str(cache_models["qwen3_5"])]) as url:
        first, second = await trio.to_thread.run_sync(session, url)
    assert first.usage.cache_read_input_tokens == 0
    prompt = first.usage.input_tokens
    assert second.usage.cache_read_input_tokens == prompt - 1  # the end-of-prompt snapshot
    assert second.usage.input_tokens + second.usage.cache_read_input_tokens == _length(cache_models["qwen3_5"], [
        SYSTEM, {"role": "user", "content": "Fix the bug"}, {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Thanks"}])


async def test_the_mtp_burst_runs_on_a_resumed_prompt_and_changes_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Temperature 0, with and without the cache, with MTP on and off: one text per turn; and the same drafts."""
    from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint

    model = build_mtp_checkpoint(tmp_path / "qwen35-partial", drafter="aligned", context_scale=0.05)
    runs = {}
    for mtp in ("0", "1"):
        monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", mtp)
        for cache in ([], ["--prompt-cache-size", "0"]):
            # Each run on its own: from another run's caches on disk, a prompt would draft from its second step.
            monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path / f"cache-{mtp}-{len(cache)}"))
            async with running_server(["--model", str(model), "--mtp", *cache]) as url:
                runs[mtp, bool(cache)] = await _agent(url, 3, max_tokens=24)
    texts = {key: [a["choices"][0]["message"]["content"] for a in answers] for key, answers in runs.items()}
    assert len(set(map(tuple, texts.values()))) == 1, texts
    resumed = runs["1", False][1:]
    assert all(a["timings"]["cached_n"] > 0 and a["timings"]["draft_n"] > 0 for a in resumed), \
        [a["timings"] for a in resumed]
    # The drafter's state was kept with the snapshot: a resumed prompt drafts as a prefilled one does.
    drafts = {cache: [(a["timings"]["draft_n"], a["timings"]["draft_n_accepted"]) for a in runs["1", cache]]
              for cache in (False, True)}
    assert drafts[False] == drafts[True], drafts
