"""One model across two processes: ``mlx.launch -n 2 --backend ring ... mlxcel serve --distributed``.

Real processes on loopback: mlx.launch starts two ranks of ``mlxcel serve``,
MLX's ring backend connects them over TCP, mlx-lm's sharded loading splits the
model, rank 0 serves HTTP. The oracle is the same checkpoint served by one
ordinary process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import jsonschema
import pytest
import trio

from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from mlxcel.testing.checkpoints import build_checkpoint, write_weight_index
from mlxcel.testing.serving import launched
from tests.server.conftest import running_server

pytestmark = pytest.mark.slow

SCHEMA = json.loads((Path(__file__).parents[2] / "docs" / "mtp-policy-v1.schema.json").read_text())
PROMPTS = ["def wrap(text, width=70):", "class Template:"]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen 3.5 target (hybrid attention, a family mlx-lm pipelines) with an MTP head and a weight index."""
    return write_weight_index(build_mtp_checkpoint(tmp_path_factory.mktemp("sharded") / "qwen35-tiny"))


async def _texts(url: str, prompts: list[str], *, concurrent: bool = False) -> list[str]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        async def one(prompt: str) -> str:
            response = await client.post("/v1/completions", json={
                "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
            assert response.status_code == 200, response.text
            return str(response.json()["choices"][0]["text"])

        if not concurrent:
            return [await one(prompt) for prompt in prompts]
        results: dict[int, str] = {}

        async def into(index: int, prompt: str) -> None:
            results[index] = await one(prompt)

        async with trio.open_nursery() as nursery:
            for index, prompt in enumerate(prompts):
                nursery.start_soon(into, index, prompt)
        return [results[i] for i in range(len(prompts))]


def _stop_rank0(url: str, launcher: subprocess.Popen[bytes], log: Path) -> None:
    """SIGINT to rank 0 (its pid from /props), as a Ctrl-C would: every rank must exit, and cleanly."""
    pid = httpx.get(f"{url}/props").json()["pid"]
    os.kill(pid, signal.SIGINT)
    assert launcher.wait(timeout=60) == 0, log.read_text()
    text = log.read_text()
    assert "rank 1/2: rank 0 stopped after" in text, text
    # mlx.launch exits 0 whatever its ranks did; it says so when one did not exit 0.
    assert "exited with code" not in text and "was killed" not in text, text


async def test_pipeline_serves_the_single_process_text_and_stops_every_rank(qwen35: Path, tmp_path: Path) -> None:
    async with running_server(["--model", str(qwen35)]) as url:
        expected = await _texts(url, PROMPTS)
    log = tmp_path / "launch.log"
    with launched(qwen35, "pipeline", log, "--mtp") as (url, launcher):
        assert await _texts(url, PROMPTS) == expected
        # Two at once: rank 0 queues them (one sequence at a time); neither text changes.
        assert await _texts(url, PROMPTS[::-1], concurrent=True) == expected[::-1]
        policy = httpx.get(f"{url}/v1/internal/mtp-policy").json()
        jsonschema.validate(policy, SCHEMA)
        assert (policy["state"], policy["reason"], policy["mtp_enabled"]) == ("unavailable", "sharded", False)
        assert policy["hardware"].endswith("-ring-x2") and policy["drafter"] is not None
        _stop_rank0(url, launcher, log)


async def test_tensor_parallel_serves_the_single_process_text(tmp_path: Path) -> None:
    llama = build_checkpoint(tmp_path / "llama-tiny", "llama", scale=2.0)  # llama: tensor parallelism only
    async with running_server(["--model", str(llama)]) as url:
        expected = await _texts(url, PROMPTS[:1])
    log = tmp_path / "launch.log"
    with launched(llama, "tensor", log) as (url, launcher):
        assert await _texts(url, PROMPTS[:1]) == expected
        policy = httpx.get(f"{url}/v1/internal/mtp-policy").json()
        assert (policy["state"], policy["reason"]) == ("unavailable", "no_mtp_dispatch")
        _stop_rank0(url, launcher, log)
