"""The bundled default pairing: `mlxcel serve` with no --model, its MTP head, and its training script."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from mlxcel.blas import blas_kind
from mlxcel.checkpoints import inspect_checkpoint
from mlxcel.serve_cli import BUNDLED_BLOCK_SIZE, BUNDLED_MODEL
from mlxcel.testing.serving import child_env, serve_subprocess
from tests.conftest import validate_wire
from tests.server.conftest import running_server, server_on_a_thread

PROMPTS = ["def read_config(path):", "class Queue:", "import os\n\n\ndef main():"]


def test_the_bundled_pairing_is_an_ordinary_checkpoint() -> None:
    info = inspect_checkpoint(BUNDLED_MODEL)  # the same checks as any user's model
    assert (info.name, info.model_type) == ("qwen35-stdlib-4m", "qwen3_5")
    size = sum(f.stat().st_size for f in BUNDLED_MODEL.iterdir())
    assert size <= 20 * 1024 * 1024
    config = json.loads((BUNDLED_MODEL / "config.json").read_text())
    assert config["mtp_num_hidden_layers"] == 1


# The burst tests run the server with the machine's default BLAS, as `mlxcel serve` does (the suite's
# process loads the one `mlxcel serve` would). OpenBLAS on the AMD EPYC CI runs on multiplies the
# pairing's 192-wide products, and its attention over 2+ queries, differently from one row: the probe
# picks the row-split verify there (docs/mtp.md).
EXACT: dict[str, str] = {}


def test_serve_without_model_serves_the_bundled_pairing_with_its_head(tmp_path: Path) -> None:
    with serve_subprocess([], EXACT, tmp_path / "serve.log") as url, httpx.Client(timeout=60) as client:
        policy = client.get(f"{url}/v1/internal/mtp-policy").json()
        validate_wire(policy)
        models = client.get(f"{url}/v1/models").json()
        completion = client.post(f"{url}/v1/completions", json={
            "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0}).json()
        chat = client.post(f"{url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 12}).json()
    assert models["data"][0]["id"] == "qwen35-stdlib-4m"
    assert (policy["target"], policy["drafter"]) == ("qwen35-stdlib-4m", "qwen35-stdlib-4m#mtp")
    assert (policy["state"], policy["block_size"]) == ("profiling", BUNDLED_BLOCK_SIZE)
    assert completion["choices"][0]["text"] and completion["timings"]["draft_rounds"] > 0
    log = (tmp_path / "serve.log").read_text()  # the probe accepted it with this machine's BLAS
    assert f"MTP exactness probe: at K={BUNDLED_BLOCK_SIZE} the burst is byte-identical to classic decode" in log
    assert chat["choices"][0]["message"]["content"] is not None


async def test_the_bundled_pairing_block_size_can_still_be_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXCEL_DRAFT_BLOCK_SIZE", "3")
    async with running_server([]) as url, httpx.AsyncClient(timeout=60) as client:
        from_env = (await client.get(f"{url}/v1/internal/mtp-policy")).json()
    async with running_server(["--draft-block-size", "5"]) as url, httpx.AsyncClient(timeout=60) as client:
        from_flag = (await client.get(f"{url}/v1/internal/mtp-policy")).json()
    assert (from_env["block_size"], from_flag["block_size"]) == (3, 5)


def _texts(tmp_path: Path, pin: str, block_size: int) -> list[dict[str, object]]:
    env = {**EXACT, "MLXCEL_ENABLE_MTP_B1": pin, "MLXCEL_DRAFT_BLOCK_SIZE": str(block_size)}
    with server_on_a_thread([], env) as url, httpx.Client(timeout=60) as client:
        return [client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 80, "temperature": 0}
                            ).json() for prompt in PROMPTS]


@pytest.mark.slow
def test_temperature_zero_text_is_the_same_with_mtp_on_and_off(tmp_path: Path) -> None:
    # At the bundled K; every K of the family: tests/server/test_mtp.py.
    on, off = _texts(tmp_path, "1", BUNDLED_BLOCK_SIZE), _texts(tmp_path, "0", BUNDLED_BLOCK_SIZE)
    assert [b["choices"][0]["text"] for b in on] == [b["choices"][0]["text"] for b in off]  # type: ignore[index]
    assert all(b["timings"]["draft_rounds"] > 0 for b in on)  # type: ignore[index]  # the burst really ran


@pytest.mark.slow
def test_a_quick_profiling_run_settles_and_persists(tmp_path: Path) -> None:
    # The documented setting, not a patched internal.
    env = {**EXACT, "MLXCEL_MTP_PROFILE_SAMPLES": "2"}
    with server_on_a_thread([], env) as url, httpx.Client(timeout=60) as client:
        for prompt in PROMPTS[:2]:
            client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 64, "temperature": 0})
        policy = client.get(f"{url}/v1/internal/mtp-policy").json()
    assert (policy["state"], policy["samples"], policy["samples_required"]) == ("settled", 2, 2)
    assert policy["verdict"] in ("enable", "decline") and 0 <= policy["acceptance_rate"] <= 1
    hints = list((Path(os.environ["MLXCEL_CACHE_DIR"]) / "mtp-policy").glob("*[!h].json"))  # not *.batch.json
    assert len(hints) == 1


@pytest.mark.slow
def test_the_training_script_is_deterministic_given_its_seed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs of one seed, in two processes (each its own hash seed): a child, and this process, which runs the
    script as ``python -m`` does (an interpreter's start and imports less than a second child)."""
    script = "mlxcel.families.qwen3_5.train_default"
    args = ["--steps", "2", "--batch", "2", "--length", "64", "--seed", "3", "--files", "40", "--out"]
    if blas_kind() == "openblas":
        # This process's OpenBLAS kept the threads it was loaded with; the script gives the child's every core
        # unless OPENBLAS_NUM_THREADS says otherwise. Both runs multiply with as many.
        monkeypatch.setenv("OPENBLAS_NUM_THREADS", str(ctypes.CDLL(None).openblas_get_num_threads()))
    subprocess.run([sys.executable, "-m", script, *args, str(tmp_path / "a")],
                   check=True, capture_output=True, timeout=600, env=child_env())
    monkeypatch.setattr(sys, "argv", [script, *args, str(tmp_path / "b")])
    runpy.run_module(script, run_name="__main__", alter_sys=True)
    digests = [{f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted((tmp_path / run).iterdir())}
               for run in ("a", "b")]
    assert digests[0] == digests[1]
    assert set(digests[0]) == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
