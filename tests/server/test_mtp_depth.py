"""MTP at depth: a lone request's rounds chosen by the rule of K at width 1 (the verdict's depth limit its
prior, the costs measured at each depth its decision), and the burst byte-identical to classic decode over a
cache past a thousand keys (``mlxcel.models.grouped_attention`` sums them in blocks)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx
import pytest

from mlxcel.blas import load_fast_blas
from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from mlxcel.hardware import detect_host, kernel_versions
from mlxcel.policy import Hint, HintStore, PairingKey
from mlxcel.policy.cost_table import FIRST_BAND_TOKENS
from tests.conftest import validate_wire
from tests.server.conftest import running_server

load_fast_blas()  # the server's hardware label names its BLAS; read it under the same one

@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mtp_checkpoint(tmp_path_factory.mktemp("depth") / "qwen35-partial", drafter="aligned",
                                context_scale=0.05)


def _settled(model: Path, depth_limit: int | None, costs: dict[int, dict[str, float]] | None = None) -> None:
    """An enable verdict for *model*'s pairing on this machine, as a restart finds it; *costs*: the rule's
    width-1 step seconds by depth band (K -> seconds), as an earlier run measured them."""
    key = PairingKey(target=model.name, drafter=f"{model.name}#mtp", hardware=detect_host().label, block_size=4)
    store = HintStore(Path(os.environ["MLXCEL_CACHE_DIR"]), kernel_versions())
    store.save(Hint(key=key, verdict="enable", acceptance_rate=0.8, samples=4, estimated_speedup=1.4,
                    depth_limit=depth_limit))
    if costs is not None:
        store.save_batch(key, {"max_drafts": 3, "cells": [
            {"width": 1, "band": band, "seconds": seconds} for band, seconds in costs.items()]})


async def _lone_answers(url: str, prompts: dict[str, str]) -> tuple[dict, dict[str, dict]]:
    """The policy's body, then each prompt's greedy completion of 12 tokens sent alone."""
    async with httpx.AsyncClient(timeout=120) as client:
        answers = {}
        for name, prompt in prompts.items():
            response = await client.post(f"{url}/v1/completions", json={
                "prompt": prompt, "max_tokens": 12, "temperature": 0})
            assert response.status_code == 200, response.text
            answers[name] = response.json()
        policy = (await client.get(f"{url}/v1/internal/mtp-policy")).json()
    validate_wire(policy)
    for answer in answers.values():
        assert answer["usage"]["completion_tokens"] == 12
    return policy, answers


SHORT, DEEP = "def wrap(text, width=70):", "import os\n" * 180  # below 1,024 tokens of context; past it


async def test_a_lone_request_past_the_depth_limit_starts_classic(model: Path) -> None:
    # The verdict's depth limit is the prior of the rule of K at width 1: a depth band starting at the limit
    # or deeper, nothing measured there, starts parked (classic steps for a cooldown); one before it is
    # measured (the classic step first, then a K).
    _settled(model, depth_limit=FIRST_BAND_TOKENS)
    async with running_server(["--model", str(model), "--mtp"]) as url:
        policy, answers = await _lone_answers(url, {"short": SHORT, "deep": DEEP})
    assert (policy["state"], policy["verdict"], policy["mtp_enabled"], policy["depth_limit"]) == (
        "settled", "enable", True, FIRST_BAND_TOKENS)
    short, deep = answers["short"], answers["deep"]
    assert short["usage"]["prompt_tokens"] < FIRST_BAND_TOKENS <= deep["usage"]["prompt_tokens"]
    assert short["timings"]["draft_rounds"] > 0
    assert deep["timings"]["draft_rounds"] == 0


async def test_the_rule_of_k_decides_a_lone_request_from_its_measured_costs(model: Path) -> None:
    # No depth limit; an earlier run measured, at width 1, three drafts paying below 1,024 tokens of context
    # and losing from there (a round 40x a classic step): the short request bursts from its first round (the
    # costs restored are trusted), the deep one runs classic steps, both under the same enable verdict.
    _settled(model, depth_limit=None, costs={0: {"0": 0.01, "1": 0.011, "2": 0.012, "3": 0.013},
                                             1: {"0": 0.01, "1": 0.4, "2": 0.4, "3": 0.4}})
    async with running_server(["--model", str(model), "--mtp", "--metrics"]) as url:
        policy, answers = await _lone_answers(url, {"short": SHORT, "deep": DEEP})
        async with httpx.AsyncClient() as client:
            metrics = (await client.get(f"{url}/metrics")).text
    assert (policy["state"], policy["verdict"], policy["depth_limit"]) == ("settled", "enable", None)
    short, deep = answers["short"], answers["deep"]
    assert short["timings"]["draft_rounds"] >= 2 and deep["timings"]["draft_rounds"] == 0
    cells = {(c["width"], c["min_depth"]): c["drafts"] for c in policy["batch"]["cells"]}
    assert cells[(1, 0)] > 0 and cells[(1, FIRST_BAND_TOKENS)] == 0
    # /metrics: the lone bursts' rounds by drafts, and their classic steps (the deep request's 12, at least).
    steps = {int(m[1]): float(m[2]) for m in re.finditer(r'^mlxcel_lone_steps_total\{drafts="(\d+)"\} (\S+)$',
                                                        metrics, re.M)}
    rounds = short["timings"]["draft_rounds"] + deep["timings"]["draft_rounds"]
    assert steps[0] >= 12 and sum(n for k, n in steps.items() if k) == rounds


@pytest.mark.parametrize("k", [2, 4])
async def test_the_burst_over_a_deep_cache_is_classic_decode(model: Path, monkeypatch: pytest.MonkeyPatch,
                                                           k: int) -> None:
    monkeypatch.setenv("MLXCEL_DRAFT_BLOCK_SIZE", str(k))
    prompt = "for line in lines:\n    total += len(line)\n" * 72  # 1,224 tokens: 20 blocks of 64 keys
    answers = {}
    for pin in ("1", "0"):
        monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", pin)
        async with running_server(["--model", str(model), "--mtp"]) as url, \
                httpx.AsyncClient(timeout=300) as client:
            response = await client.post(f"{url}/v1/completions", json={
                "prompt": prompt, "max_tokens": 40, "temperature": 0})
            assert response.status_code == 200, response.text
            answers[pin] = response.json()
    on, off = answers["1"], answers["0"]
    assert on["usage"]["prompt_tokens"] > 1024  # many blocks of keys: a deep cache, as a user has
    assert on["timings"]["draft_rounds"] > 0 and off["timings"]["draft_rounds"] == 0
    assert on["choices"][0]["text"] == off["choices"][0]["text"]
    assert on["usage"]["completion_tokens"] == 40
