"""Speculation inside the continuous batch, through real HTTP, on tiny Qwen 3.5 checkpoints with ``mtp.*`` heads."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from tests.conftest import validate_wire
from tests.server.conftest import open_stream, running_server, server_on_a_thread

PROMPTS = ["def wrap(text, width=70):", "class Template:", "import os\nimport sys\n", "for i in range(10):",
           "x = [", "while True:"]


@pytest.fixture(scope="module")
def partial(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # The head mostly, not always, agrees with the target: rows keep different counts and roll back apart.
    return build_mtp_checkpoint(tmp_path_factory.mktemp("batch-mtp") / "qwen35-partial", drafter="aligned",
                                context_scale=0.05)


async def _at_once(url: str, requests: list[dict[str, object]], stagger: float = 0.0) -> list[dict[str, object]]:
    """*requests* sent together (each *stagger* seconds after the one before), their bodies in order."""
    bodies: list[dict[str, object]] = [{} for _ in requests]
    async with httpx.AsyncClient(timeout=120) as client:
        async def one(i: int) -> None:
            await trio.sleep(i * stagger)
            response = await client.post(f"{url}/v1/completions", json=requests[i])
            assert response.status_code == 200, response.text
            bodies[i] = response.json()
        async with trio.open_nursery() as nursery:
            for i in range(len(requests)):
                nursery.start_soon(one, i)
    return bodies


def _classic_sets() -> dict[str, tuple[list[dict[str, object]], float]]:
    """The request sets the exactness tests compare with classic decode, by name: (requests, stagger)."""
    return {
        # Six requests for four places, different lengths: rows join a speculating batch and leave it mid-way.
        "joining": ([{"prompt": p, "max_tokens": 20 + 9 * i, "temperature": 0} for i, p in enumerate(PROMPTS)],
                    0.02),
        # Rows that cannot draft (a grammar, logprobs) beside rows that can.
        "riding": ([{"prompt": PROMPTS[0], "max_tokens": 70, "temperature": 0},
                    {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0,
                     "response_format": {"type": "json_schema", "json_schema": {"name": "row", "schema": SCHEMA}}},
                    {"prompt": PROMPTS[2], "max_tokens": 10, "temperature": 0, "logprobs": 2},
                    {"prompt": PROMPTS[3], "max_tokens": 70, "temperature": 0}], 0.0),
        "staying": ([{"prompt": p, "max_tokens": 60, "temperature": 0} for p in PROMPTS[:3]], 0.0),
    }


@pytest.fixture(scope="module")
def classic(partial: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Classic decode's answers (MTP pinned off) to each of :func:`_classic_sets`, each set sent together as its
    test sends it to the speculating server, one set after the other to one server without a prompt cache (so
    each set is prefilled as on a fresh server); then that server's policy ``batch`` and batch steps by drafts.
    MLXCEL_DRAFT_BLOCK_SIZE is left unset: pinned off, the batch drafts nothing at any K."""
    env = {"MLXCEL_CACHE_DIR": str(tmp_path_factory.mktemp("batch-mtp-classic")), "MLXCEL_ENABLE_MTP_B1": "0"}
    argv = ["--model", str(partial), "--mtp", "--parallel", "4", "--metrics", "--prompt-cache-size", "0"]
    with server_on_a_thread(argv, env) as url:
        answers: dict[str, Any] = {name: trio.run(_at_once, url, requests, stagger)
                                   for name, (requests, stagger) in _classic_sets().items()}
        return {**answers, "batch": trio.run(_policy_batch, url), "steps": trio.run(_steps, url)}


async def _policy_batch(url: str) -> dict[str, object]:
    async with httpx.AsyncClient() as client:
        body = (await client.get(f"{url}/v1/internal/mtp-policy")).json()
    validate_wire(body)
    batch: dict[str, object] = body["batch"]
    return batch


async def _steps(url: str) -> dict[str, float]:
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"{url}/metrics")).text
    return {m[1]: float(m[2]) for m in re.finditer(r'^mlxcel_batch_steps_total\{drafts="(\d+)"\} (\S+)$', text, re.M)}


async def _serve_all(model: Path, monkeypatch: pytest.MonkeyPatch, pin: str, k: int,
                     requests: list[dict[str, object]], stagger: float) -> tuple[list[dict[str, object]], dict]:
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", pin)
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(model.parent / f"cache-{pin}-{k}"))  # no prompt cache from the other
    monkeypatch.setenv("MLXCEL_DRAFT_BLOCK_SIZE", str(k))
    async with running_server(["--model", str(model), "--mtp", "--parallel", "4", "--metrics"]) as url:
        bodies = await _at_once(url, requests, stagger)
        batch = await _policy_batch(url)
        if pin == "0":
            assert batch == {"speculates": False, "reason": "MTP is pinned off (MLXCEL_ENABLE_MTP_B1)", "cells": []}
        else:
            assert batch["speculates"] is True and batch["reason"] is None
        return bodies, await _steps(url)


@pytest.mark.parametrize("k", [2, 4])
async def test_temperature_zero_text_is_classic_decodes_with_rows_joining_and_leaving(
        partial: Path, classic: dict[str, Any], monkeypatch: pytest.MonkeyPatch, k: int) -> None:
    requests, stagger = _classic_sets()["joining"]  # six requests for four places, of different lengths
    speculative, steps = await _serve_all(partial, monkeypatch, "1", k, requests, stagger)
    expected: list[dict[str, Any]] = classic["joining"]
    assert [b["choices"][0]["text"] for b in speculative] == [b["choices"][0]["text"] for b in expected]  # type: ignore[index]
    assert [b["usage"] for b in speculative] == [b["usage"] for b in expected]
    assert classic["batch"] == {"speculates": False, "reason": "MTP is pinned off (MLXCEL_ENABLE_MTP_B1)", "cells": []}
    assert set(classic["steps"]) <= {"0"}  # MTP pinned off: the batch never drafts
    assert steps.get(str(k - 1), 0) > 0  # pinned on: the batch verified K - 1 drafts per row
    drafted = sum(b["timings"]["draft_n"] for b in speculative)  # type: ignore[index]
    accepted = sum(b["timings"]["draft_n_accepted"] for b in speculative)  # type: ignore[index]
    assert 0 < accepted < drafted  # rows kept some drafts and rolled the others back
    widths = [b["timings"]["draft_widths"] for b in speculative]  # type: ignore[index]
    assert all(w == sorted(set(w)) and all(1 <= n <= 4 for n in w) for w in widths)
    assert any(n >= 2 for w in widths for n in w)  # drafted beside others (which widths: arrival timing)
    assert all(b["timings"]["draft_widths"] == [] for b in expected)


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"]}


async def test_rows_that_cannot_draft_share_a_speculating_batch(
        partial: Path, classic: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    # A grammar row and a logprobs row ride along at K=0 in the speculative steps of the rows beside them
    # (their tokens by their own processors and sampler, from the verify's first position); sampled rows
    # speculate by speculative sampling with their own seeds.
    requests, _ = _classic_sets()["riding"]
    sampled: list[dict[str, object]] = [{"prompt": PROMPTS[4], "max_tokens": 50, "temperature": 0.8, "seed": 7},
                                        {"prompt": PROMPTS[5], "max_tokens": 50, "temperature": 0.8, "seed": 8}]
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "1")
    monkeypatch.setenv("MLXCEL_DRAFT_BLOCK_SIZE", "3")
    async with running_server(["--model", str(partial), "--mtp", "--parallel", "4", "--metrics"]) as url:
        speculative = await _at_once(url, requests)
        steps = await _steps(url)
        # Then the sampled rows, on the same server: the steps counted from here are theirs.
        bodies = await _at_once(url, sampled)
        sampled_steps = await _steps(url)
        batch = await _policy_batch(url)
    assert batch["speculates"] is True and batch["reason"] is None
    for got, expected in zip(speculative, classic["riding"], strict=True):
        g, e = got["choices"][0], expected["choices"][0]  # type: ignore[index]
        assert (g["text"], g["finish_reason"]) == (e["text"], e["finish_reason"])
        if e["logprobs"] is not None:
            # The same tokens, and their log-probabilities to the last bit: a row's step is the same bytes
            # whatever rows share it and however much padding speculation's rollbacks put in front of it
            # (tests/engine/test_batch_invariance.py), so a near-tie would fall the same way in both runs.
            assert g["logprobs"] == e["logprobs"], (g["logprobs"], e["logprobs"])
    assert steps.get("2", 0) > 0
    assert [b["timings"]["draft_n"] for b in speculative[1:3]] == [0, 0]  # type: ignore[index]
    # The drafting rows speculated while all four shared the batch (before, its steps ran classic then).
    assert 4 in speculative[0]["timings"]["draft_widths"]  # type: ignore[index]

    assert sampled_steps.get("2", 0) > steps.get("2", 0)
    for body in bodies:
        assert body["usage"]["completion_tokens"] == 50  # type: ignore[index]
        assert body["timings"]["draft_n_accepted"] > 0  # type: ignore[index]


async def test_a_client_that_leaves_mid_generation_leaves_the_others_exact(
        partial: Path, classic: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    requests, _ = _classic_sets()["staying"]
    expected: list[dict[str, Any]] = classic["staying"]
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "1")
    monkeypatch.setenv("MLXCEL_DRAFT_BLOCK_SIZE", "3")
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(partial.parent / "cache-leaving"))
    async with running_server(["--model", str(partial), "--mtp", "--parallel", "4", "--metrics"]) as url:
        async def leaver() -> None:
            stream = await open_stream(url, "/v1/completions", {"prompt": PROMPTS[4], "max_tokens": 400,
                                                                 "temperature": 0, "stream": True})
            await trio.sleep(0.3)  # while the batch speculates
            await stream.aclose()  # gone mid-generation

        bodies: list[dict[str, object]] = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(leaver)
            bodies = await _at_once(url, requests)
        assert (await _steps(url)).get("2", 0) > 0
        after = await _at_once(url, requests[:1])  # and the server goes on
    assert [b["choices"][0]["text"] for b in bodies] == [b["choices"][0]["text"] for b in expected]  # type: ignore[index]
    assert after[0]["choices"][0]["text"] == expected[0]["choices"][0]["text"]  # type: ignore[index]


async def test_the_rule_parks_a_head_that_never_agrees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Unpinned: the batch's rule measures the speculative steps losing to the classic step, parks them, and
    # publishes that it runs the classic step there; the text is classic decode's throughout.
    model = build_mtp_checkpoint(tmp_path / "qwen35-random", drafter="random")
    requests: list[dict[str, object]] = [{"prompt": p, "max_tokens": 90, "temperature": 0} for p in PROMPTS[:3]]
    classic, _ = await _serve_all(model, monkeypatch, "0", 3, requests, 0.0)
    monkeypatch.delenv("MLXCEL_ENABLE_MTP_B1")
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path / "cache-rule"))
    async with running_server(["--model", str(model), "--mtp", "--parallel", "4", "--metrics"]) as url:
        bodies = await _at_once(url, requests)
        steps, batch = await _steps(url), await _policy_batch(url)
    assert [b["choices"][0]["text"] for b in bodies] == [b["choices"][0]["text"] for b in classic]  # type: ignore[index]
    speculative = sum(n for k, n in steps.items() if k != "0")
    assert 0 < speculative < steps.get("0", 0) / 3  # tried, then parked: the classic step runs most of the time
    # Published: where rows decoded together, the rule runs the classic step (which widths they met at
    # depends on how the requests' arrivals interleave with the first one's solo turn).
    together = [c for c in batch["cells"] if c["width"] >= 2]  # type: ignore[attr-defined,index]
    assert together and any(c["drafts"] == 0 for c in together)
    # The step costs were kept beside the policy's hint: a restart knows them before its first request.
    async with running_server(["--model", str(model), "--mtp", "--parallel", "4"]) as url:
        restored = await _policy_batch(url)
    published = {(c["width"], c["min_depth"]) for c in batch["cells"]}  # type: ignore[attr-defined,index]
    # Every cell it had published, and those measured after its last publication, saved when it stopped.
    assert {(c["width"], c["min_depth"]) for c in restored["cells"]} >= published  # type: ignore[attr-defined,index]


async def test_a_batch_probe_that_cannot_run_leaves_lone_requests_their_burst(
        partial: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On MLX's CUDA backend the batch's probe raised (a CUDA graph node failed to build) and the engine stopped,
    taking the server with it. A GPU cannot run here: the probe's failure is what the test is about, and the
    burst, the classic batch and the policy endpoint are the real ones."""
    from mlxcel.engine import exactness

    def broken(*args: object, **kwargs: object) -> dict[int, str]:
        raise RuntimeError("cudaGraphAddKernelNode(&node, graph_, NULL, 0, &params) failed: invalid argument")

    monkeypatch.setattr(exactness, "probe_batch_widths", broken)
    monkeypatch.setenv("MLXCEL_CACHE_DIR", str(partial.parent / "cache-broken-probe"))
    async with running_server(["--model", str(partial), "--mtp", "--parallel", "4", "--metrics"]) as url:
        lone = await _at_once(url, [{"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}])
        both = await _at_once(url, [{"prompt": p, "max_tokens": 16, "temperature": 0} for p in PROMPTS[:2]])
        batch = await _policy_batch(url)
    assert {k: v for k, v in batch.items() if k != "cells"} == {"speculates": False,
                     "reason": "the batch's exactness probe could not run: RuntimeError: cudaGraphAddKernelNode"
                               "(&node, graph_, NULL, 0, &params) failed: invalid argument"}
    assert lone[0]["timings"]["draft_rounds"] > 0  # type: ignore[index]  # the B=1 burst still runs
    assert batch["cells"] == []  # width 1's, the lone burst's, are left out while its policy profiles
    assert [b["usage"]["completion_tokens"] for b in both] == [16, 16]  # type: ignore[index]
