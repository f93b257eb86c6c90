"""Inkling served by the real CLI and server, over HTTP, against transformers' greedy decode."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import trio

from mlxcel.families.inkling.tiny import UNPADDED, build_target, load_reference
from tests.server.conftest import b1_verdict, refused, running_server, server_on_a_thread

torch = pytest.importorskip("torch")

PROMPTS = [[int(t) for t in np.random.default_rng(i).integers(3, UNPADDED, 20 + 7 * i)] for i in range(3)]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_target(tmp_path_factory.mktemp("inkling-serve") / "inkling-tiny", seed=1)


def _greedy(hf: Any, prompt: list[int], count: int) -> list[int]:
    """transformers' greedy continuation of *prompt*, cut at the end-of-sequence token."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=count, do_sample=False)[0, len(prompt):].tolist()
    return out[:out.index(2)] if 2 in out else out


@pytest.mark.slow
async def test_concurrent_requests_decode_solo_as_transformers_and_reuse_the_prefix_cache(checkpoint: Path) -> None:
    from mlxcel.checkpoints import inspect_checkpoint, load_checkpoint

    _, tokenizer = load_checkpoint(inspect_checkpoint(checkpoint))
    hf = load_reference(checkpoint)
    continuations = [_greedy(hf, prompt, 32) for prompt in PROMPTS]
    # The first conversation's next turn: what the server cached for it (prompt and reply), then more.
    follow_up = [*PROMPTS[0], *continuations[0], 7, 8, 9]
    expected = [tokenizer.decode(c) for c in [*continuations, _greedy(hf, follow_up, 32)]]
    async with running_server(["--model", str(checkpoint), "--parallel", "3"]) as url, \
            httpx.AsyncClient(base_url=url, timeout=120) as client:
        texts: dict[int, str] = {}

        async def complete(i: int, prompt: list[int]) -> None:
            response = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 32,
                                                                   "temperature": 0})
            assert response.status_code == 200, response.text
            texts[i] = response.json()["choices"][0]["text"]

        async with trio.open_nursery() as nursery:  # together: queued, served one at a time
            for i, prompt in enumerate(PROMPTS):
                nursery.start_soon(complete, i, prompt)
        await complete(len(PROMPTS), follow_up)  # extends a cached prompt
        stats: dict[str, Any] = (await client.get("/v1/cache/stats")).json()
    assert [texts[i] for i in range(len(expected))] == expected
    assert stats["hits"] >= 1 and stats["reused_tokens"] >= len(PROMPTS[0]) + 16, stats


def test_a_directory_with_only_the_mtp_file_is_refused_as_a_target_in_one_line(checkpoint: Path,
                                                                                tmp_path: Path) -> None:
    only = tmp_path / "inkling-mtp-only"
    only.mkdir()
    shutil.copy(checkpoint / "config.json", only)
    shutil.copy(checkpoint / "model.safetensors", only / "mtp.safetensors")  # any valid safetensors file
    assert refused("--model", str(only)).strip().splitlines()[-1].endswith(
        "holds only an MTP drafter (mtp.safetensors), no target weights: pass it as --draft-model, "
        "with the target checkpoint as --model")


@pytest.fixture(scope="module")
def with_head(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mlxcel.families.inkling.tiny import build_mtp

    target = build_target(tmp_path_factory.mktemp("inkling-mtp-serve") / "inkling-mtp-tiny", mtp_layers=1)
    build_mtp(target)
    return target


def _served_texts(target: Path, tmp_path: Path, args: list[str], prompts: list[list[int]] = PROMPTS,
                  **env: str) -> tuple[list[dict[str, Any]], Any]:
    """Completions of *prompts* at temperature 0, and the server's policy afterwards.

    The server runs in a process of its own when *env* chooses the BLAS (a process-wide choice), else in
    this one.
    """
    from mlxcel.testing.serving import serve_subprocess

    log = tmp_path / f"serve-{len(list(tmp_path.glob('serve-*')))}.log"
    settings = {"MLXCEL_CACHE_DIR": str(tmp_path / "cache"), **env}
    argv = ["--model", str(target), *args]
    server = serve_subprocess(argv, settings, log) if "MLXCEL_BLAS" in env else server_on_a_thread(argv, settings)
    with server as url, httpx.Client(base_url=url, timeout=120) as client:
        bodies = []
        for prompt in prompts:
            response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24, "temperature": 0})
            response.raise_for_status()
            bodies.append(response.json())
        return bodies, client.get("/v1/internal/mtp-policy").json()


@pytest.mark.slow
def test_temperature_0_text_with_mtp_is_classic_decode_byte_for_byte(with_head: Path, tmp_path: Path) -> None:
    classic, _ = _served_texts(with_head, tmp_path, ["--mtp"], MLXCEL_ENABLE_MTP_B1="0")
    for args in (["--mtp"], ["--draft-model", str(with_head)]):  # the full directory: only its mtp.safetensors
        burst, policy = _served_texts(with_head, tmp_path, args, MLXCEL_ENABLE_MTP_B1="1")
        assert [b["choices"][0]["text"] for b in burst] == [b["choices"][0]["text"] for b in classic]
        assert policy["state"] == "forced" and policy["block_size"] == 3, policy
        assert all(b["timings"]["draft_rounds"] > 0 for b in burst)


@pytest.fixture(scope="module")
def permutation_pairs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The permutation target, in two directories: one with the agreeing head, one with a random one."""
    from mlxcel.families.inkling.tiny import build_mtp

    root = tmp_path_factory.mktemp("inkling-permutation-serve")
    # A 1,100-token context: the servers below run under the reference BLAS, where each start's exactness
    # probe prefills its deep case (as deep as the context allows) for real: ~6 s at 4,096 positions.
    target = build_target(root / "inkling-permutation", kind="permutation", mtp_layers=1,
                          max_position_embeddings=1100)
    pairs = {}
    for kind in ("agreeing", "random"):
        pairs[kind] = root / f"inkling-permutation-{kind}"
        shutil.copytree(target, pairs[kind])
        build_mtp(pairs[kind], kind=kind)
    return pairs


@pytest.mark.slow
def test_the_policy_profiles_settles_and_restores(permutation_pairs: dict[str, Path], tmp_path: Path) -> None:
    # (A new K is a new pairing to profile: tests/server/test_gemma4.py checks it, through the same policy.)
    # Under mlx's reference BLAS, where the wide verify is exact and a round's products cost enough that
    # the agreeing head's burst clearly pays (under OpenBLAS the row split's verdict is near the line).
    env = {"MLXCEL_MTP_PROFILE_SAMPLES": "2", "MLXCEL_DRAFT_BLOCK_SIZE": "4", "MLXCEL_BLAS": "off"}
    verdicts = {}
    for kind, target in permutation_pairs.items():
        bodies, verdicts[kind] = _served_texts(target, tmp_path, ["--mtp"], PROMPTS[:2], **env)
        assert all(b["timings"]["draft_rounds"] > 0 for b in bodies)  # the two profiled requests
    agreeing, random = verdicts["agreeing"], verdicts["random"]
    assert agreeing["drafter"] == "inkling-permutation-agreeing#mtp"
    assert (agreeing["state"], agreeing["verdict"], agreeing["acceptance_rate"]) == ("settled", "enable", 1.0)
    assert (random["state"], random["verdict"], random["mtp_enabled"]) == ("settled", "decline", False)
    assert random["acceptance_rate"] < 0.2
    assert len(list((tmp_path / "cache" / "mtp-policy").glob("*[!h].json"))) == 2  # hints kept for the next start
    _, restored = _served_texts(permutation_pairs["agreeing"], tmp_path, ["--mtp"], [], **env)
    assert b1_verdict(restored) == b1_verdict(agreeing)  # restored, not measured again


@pytest.mark.requires_openblas  # what this checks is OpenBLAS's kernels; CI requires it
@pytest.mark.slow
async def test_under_openblas_the_inkling_pairing_is_exact_and_the_burst_is_classic_decode(
        with_head: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unlike the tiny Gemma pairings, OpenBLAS does not leave this one without an exact split (which one
    depends on the CPU's kernels: tests/engine/test_inkling_mtp.py), so the burst runs in-process, under
    OpenBLAS, and equals classic decode."""
    texts = {}
    for pinned in ("0", "1"):
        monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", pinned)
        async with running_server(["--model", str(with_head), "--mtp", "--draft-block-size", "4"]) as url, \
                httpx.AsyncClient(base_url=url, timeout=120) as client:
            policy = (await client.get("/v1/internal/mtp-policy")).json()
            bodies = [(await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 24,
                                                                   "temperature": 0})).json() for prompt in PROMPTS]
        texts[pinned] = [b["choices"][0]["text"] for b in bodies]
        assert policy["decline_detail"] is None, policy
        assert all((b["timings"]["draft_rounds"] > 0) == (pinned == "1") for b in bodies)
    assert texts["1"] == texts["0"]
