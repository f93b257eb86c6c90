"""Logits processors inside the MTP burst: a grammar, penalties and a logit bias at every verified position.

Real servers on a tiny Qwen 3.5 target whose in-checkpoint head mostly, not
always, agrees with it. The oracle for temperature 0 is classic decode (MTP
off), which applies the same processors through mlx-lm's per-step path; the
oracle for "valid" is ``jsonschema``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import trio
from tokenizers import Tokenizer

from mlxcel.engine.instrument import Hooks
from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from tests.server.conftest import running_server, server_on_a_thread
from tests.server.test_structured import AS_PERSON, CHAT, PERSON

PROMPT = "def wrap(text, width=70):"
PENALTIES = {"repetition_penalty": 3.0, "repetition_context_size": 20, "frequency_penalty": 0.5}
LONG, SHORT = 60, 7
"""max_tokens: whole rounds (the JSON completes), and a last round narrowed by max_tokens at every K."""


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mtp_checkpoint(tmp_path_factory.mktemp("mtp-processors") / "qwen35-partial", drafter="aligned",
                                context_scale=0.05)


async def _post(client: httpx.AsyncClient, route: str, body: dict[str, Any]) -> dict[str, Any]:
    response = await client.post(route, json={"temperature": 0, **body})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def _text(body: dict[str, Any]) -> str:
    choice = body["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def _requests(bias: dict[str, float]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Every constrained, penalised and biased request of the comparison, by name."""
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for n in (LONG, SHORT):
        out[f"person-{n}"] = ("/v1/chat/completions", {"messages": CHAT, "max_tokens": n,
                                                       "response_format": AS_PERSON})
        out[f"penalised-{n}"] = ("/v1/completions", {"prompt": PROMPT, "max_tokens": n, **PENALTIES})
        out[f"biased-{n}"] = ("/v1/completions", {"prompt": PROMPT, "max_tokens": n, "logit_bias": bias})
    return out


def _bias(target: Path, plain: dict[str, Any]) -> dict[str, float]:
    """A logit bias that bans the first token of *plain*'s text (classic decode's, no processors)."""
    return {str(Tokenizer.from_file(str(target / "tokenizer.json")).encode(_text(plain)).ids[0]): -100.0}


@pytest.fixture(scope="module")
def classic(target: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Classic decode's answers (MTP pinned off), by name, to every request the tests compare the burst's with,
    asked one after the other of one server: "plain" (no processors, LONG tokens), each of :func:`_requests`
    with :func:`_bias` of it, and "person-slow" (the handoff test's stream)."""
    async def ask(url: str) -> dict[str, dict[str, Any]]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            answers = {"plain": await _post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": LONG})}
            requests = {**_requests(_bias(target, answers["plain"])), "person-slow": (
                "/v1/chat/completions", {"messages": CHAT, "max_tokens": SLOW_STREAM, "response_format": AS_PERSON})}
            for name, (route, body) in requests.items():
                answers[name] = await _post(client, route, body)
        return answers

    env = {"MLXCEL_CACHE_DIR": str(tmp_path_factory.mktemp("mtp-processors-classic")), "MLXCEL_ENABLE_MTP_B1": "0"}
    with server_on_a_thread(["--model", str(target), "--mtp"], env) as url:
        return trio.run(ask, url)


async def _serve(target: Path, monkeypatch: pytest.MonkeyPatch, pin: str, k: int,
                 requests: dict[str, tuple[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", pin)
    monkeypatch.setenv("MLXCEL_DRAFT_BLOCK_SIZE", str(k))
    async with running_server(["--model", str(target), "--mtp"]) as url, \
            httpx.AsyncClient(base_url=url, timeout=120) as client:
        return {name: await _post(client, route, body) for name, (route, body) in requests.items()}


async def test_processors_in_the_burst_give_classic_decodes_text_at_every_k(
        target: Path, classic: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    plain = _text(classic["plain"])
    requests = _requests(_bias(target, classic["plain"]))  # the plain text's first token banned
    expected = {name: classic[name] for name in requests}
    # The processors change the text (so matching it means applying them), and classic decode drafts nothing.
    assert _text(expected[f"penalised-{LONG}"]) != plain and _text(expected[f"biased-{LONG}"]) != plain
    jsonschema.validate(json.loads(_text(expected[f"person-{LONG}"])), PERSON)
    assert all(body["timings"]["draft_n"] == 0 for body in expected.values())

    for k in (2, 3, 4):
        speculative = await _serve(target, monkeypatch, "1", k, requests)
        assert {n: _text(b) for n, b in speculative.items()} == {n: _text(b) for n, b in expected.items()}, k
        for name, body in speculative.items():
            assert body["timings"]["draft_rounds"] > 0, (k, name)  # each one really ran the burst
        for kind in ("person", "penalised", "biased"):
            proposed = sum(b["timings"]["draft_n"] for n, b in speculative.items() if n.startswith(kind))
            accepted = sum(b["timings"]["draft_n_accepted"] for n, b in speculative.items() if n.startswith(kind))
            # Kept drafts and rejected ones: the matcher and the penalties' context roll back mid-round.
            assert 0 < accepted < proposed, (k, kind)


async def test_sampled_constrained_requests_in_the_burst_follow_the_schema(
        target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    requests = {f"seed-{seed}": ("/v1/chat/completions", {
        "messages": CHAT, "max_tokens": 80, "temperature": 1.0, "seed": seed, "response_format": AS_PERSON})
        for seed in range(4)}
    sampled = await _serve(target, monkeypatch, "1", 3, requests)
    for body in sampled.values():
        assert body["choices"][0]["finish_reason"] == "stop" and body["timings"]["draft_rounds"] > 0
        jsonschema.validate(json.loads(_text(body)), PERSON)
    assert len({_text(body) for body in sampled.values()}) > 1  # really sampled


async def test_a_draft_the_grammar_forbids_is_never_emitted(target: Path, classic: dict[str, dict[str, Any]],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A head that always drafts a raw control character, which JSON never allows: every draft is
    rejected, and the text is classic decode's valid JSON."""
    import mlx.core as mx

    from mlxcel.models.drafters.own_cache import OwnCacheSequence

    forbidden = Tokenizer.from_file(str(target / "tokenizer.json")).encode("\x01").ids
    assert len(forbidden) == 1
    requests = {"person": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": LONG,
                                                    "response_format": AS_PERSON})}
    real = OwnCacheSequence.draft

    def draft(self: OwnCacheSequence, count: int) -> mx.array:
        real(self, count)  # the head's own state moves on as usual; only its proposals are replaced
        return mx.full((1, count), forbidden[0], dtype=mx.int32)

    monkeypatch.setattr(OwnCacheSequence, "draft", draft)
    speculative = await _serve(target, monkeypatch, "1", 3, requests)
    timings = speculative["person"]["timings"]
    assert timings["draft_n"] > 0 and timings["draft_n_accepted"] == 0
    assert _text(speculative["person"]) == _text(classic[f"person-{LONG}"])
    jsonschema.validate(json.loads(_text(speculative["person"])), PERSON)


SLOW_STREAM = 59
"""max_tokens of the stream whose rounds the handoff test slows down (so the second request comes mid-way)."""


def _slow_rounds(point: str, request: Any) -> None:
    if point == "verify" and request.max_tokens == SLOW_STREAM:
        time.sleep(0.02)


async def test_a_constrained_burst_joined_mid_way_moves_into_the_batch_with_its_grammar(
        target: Path, classic: dict[str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch) -> None:
    """The matcher, rolled back after every round, is where the batch expects it: same text after the move."""
    body = {"messages": CHAT, "max_tokens": SLOW_STREAM, "response_format": AS_PERSON}
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "1")
    joined, last, during = "", None, []
    slow = Hooks(at=_slow_rounds)
    async with running_server(["--model", str(target), "--mtp", "--metrics"], instrument=slow) as url, \
            httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def second() -> None:
            during.append(await _post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 20}))

        async with client.stream("POST", "/v1/chat/completions", json={**body, "temperature": 0, "stream": True}) \
                as response, trio.open_nursery() as nursery:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    last = chunk if "timings" in chunk else last
                    joined += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
                    if joined and not nursery.child_tasks and not during:
                        nursery.start_soon(second)
        metrics = (await client.get("/metrics")).text
    assert joined == _text(classic["person-slow"])
    assert last is not None and last["timings"]["draft_rounds"] > 0  # it ran the burst before it moved
    assert "mlxcel_solo_handoffs_total 1.0" in metrics and during
