"""MTP at depth: a settled enable verdict's depth limit, and the burst byte-identical to classic decode over a
cache deep enough that a lone query attends grouped (``mlxcel.models.grouped_attention``)."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from mlxcel.blas import load_fast_blas
from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from mlxcel.hardware import detect_host, kernel_versions
from mlxcel.models.grouped_attention import GROUPED_FROM
from mlxcel.policy import Hint, HintStore, PairingKey
from tests.conftest import validate_wire
from tests.server.conftest import running_server

load_fast_blas()  # the server's hardware label names its BLAS; read it under the same one

LIMIT = 48


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mtp_checkpoint(tmp_path_factory.mktemp("depth") / "qwen35-partial", drafter="aligned",
                                context_scale=0.05)


async def test_requests_past_the_depth_limit_skip_the_burst(model: Path) -> None:
    key = PairingKey(target=model.name, drafter=f"{model.name}#mtp", hardware=detect_host().label, block_size=4)
    HintStore(Path(os.environ["MLXCEL_CACHE_DIR"]), kernel_versions()).save(
        Hint(key=key, verdict="enable", acceptance_rate=0.8, samples=4, estimated_speedup=1.4, depth_limit=LIMIT))
    async with running_server(["--model", str(model), "--mtp"]) as url, httpx.AsyncClient(timeout=120) as client:
        policy = (await client.get(f"{url}/v1/internal/mtp-policy")).json()
        validate_wire(policy)
        answers = {}
        for name, prompt in {"short": "def wrap(text, width=70):", "long": "import os\n" * 40}.items():
            response = await client.post(f"{url}/v1/completions", json={
                "prompt": prompt, "max_tokens": 24, "temperature": 0})
            assert response.status_code == 200, response.text
            answers[name] = response.json()
    assert (policy["state"], policy["verdict"], policy["mtp_enabled"], policy["depth_limit"]) == (
        "settled", "enable", True, LIMIT)
    short, long = answers["short"], answers["long"]
    assert short["usage"]["prompt_tokens"] < LIMIT <= long["usage"]["prompt_tokens"]
    assert short["timings"]["draft_rounds"] > 0
    assert long["timings"]["draft_rounds"] == 0 and long["usage"]["completion_tokens"] == 24


@pytest.mark.parametrize("k", [2, 4])
async def test_the_burst_over_a_deep_cache_is_classic_decode(model: Path, monkeypatch: pytest.MonkeyPatch,
                                                           k: int) -> None:
    monkeypatch.setenv("MLXCEL_DRAFT_BLOCK_SIZE", str(k))
    prompt = "for line in lines:\n    total += len(line)\n" * 200
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
    assert on["usage"]["prompt_tokens"] > GROUPED_FROM
    assert on["timings"]["draft_rounds"] > 0 and off["timings"]["draft_rounds"] == 0
    assert on["choices"][0]["text"] == off["choices"][0]["text"]
    assert on["usage"]["completion_tokens"] == 40
