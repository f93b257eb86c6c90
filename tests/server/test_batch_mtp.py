"""Speculation inside the continuous batch, through real HTTP, on tiny Qwen 3.5 checkpoints with ``mtp.*`` heads."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import trio

from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from tests.server.conftest import running_server

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
        return bodies, await _steps(url)


@pytest.mark.parametrize("k", [2, 4])
async def test_temperature_zero_text_is_classic_decodes_with_rows_joining_and_leaving(
        partial: Path, monkeypatch: pytest.MonkeyPatch, k: int) -> None:
    # Six requests for four places, different lengths: rows join a speculating batch and leave it mid-way.
    requests: list[dict[str, object]] = [
        {"prompt": p, "max_tokens": 20 + 9 * i, "temperature": 0} for i, p in enumerate(PROMPTS)]
    classic, classic_steps = await _serve_all(partial, monkeypatch, "0", k, requests, 0.02)
    speculative, steps = await _serve_all(partial, monkeypatch, "1", k, requests, 0.02)
    assert [b["choices"][0]["text"] for b in speculative] == [b["choices"][0]["text"] for b in classic]  # type: ignore[index]
    assert [b["usage"] for b in speculative] == [b["usage"] for b in classic]
    assert set(classic_steps) <= {"0"}  # MTP pinned off: the batch never drafts
    assert steps.get(str(k - 1), 0) > 0  # pinned on: the batch verified K - 1 drafts per row
    drafted = sum(b["timings"]["draft_n"] for b in speculative)  # type: ignore[index]
    accepted = sum(b["timings"]["draft_n_accepted"] for b in speculative)  # type: ignore[index]
    assert 0 < accepted < drafted  # rows kept some drafts and rolled the others back
