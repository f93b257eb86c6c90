"""Gemma 4 with its assistant through the real CLI, server and HTTP.

The servers run in this process, under the BLAS it loaded (the one `mlxcel serve` would load on this
machine). This machine's OpenBLAS multiplies a 2-row block of these shapes with another kernel than one
row, and its attention over 2+ queries differs from one query's, so the wide verify is inexact; the
probe's row-split verify is not, and the probe finds it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from mlxcel.families.gemma4.tiny import build_assistant, build_target
from tests.server.conftest import b1_verdict, refused, running_server, server_on_a_thread

pytest.importorskip("torch")

PROMPTS = ["def wrap(text, width=70):", "class Template:", "import os\n"]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma4-serve")
    target = build_target(root / "gemma4-tiny", wrapper=True)
    permutation = build_target(root / "gemma4-permutation", kind="permutation")
    return {
        "target": target, "assistant": build_assistant(root / "gemma4-tiny-assistant", target),
        "permutation": permutation,
        "agreeing": build_assistant(root / "gemma4-agreeing-assistant", permutation, kind="agreeing"),
        "partly": build_assistant(root / "gemma4-partly-assistant", permutation, kind="agreeing", agreement=0.6),
        "random": build_assistant(root / "gemma4-random-assistant", permutation),
    }


@contextmanager
def _exact_server(target: Path, assistant: Path, tmp_path: Path, **env: str) -> Iterator[httpx.Client]:
    settings = {"MLXCEL_CACHE_DIR": str(tmp_path / "cache"), **env}
    with server_on_a_thread(["--model", str(target), "--draft-model", str(assistant)], settings) as url, \
            httpx.Client(base_url=url, timeout=120) as client:
        yield client


def _texts(client: httpx.Client, max_tokens: int, prompts: list[str] = PROMPTS, **extra: Any) -> list[dict[str, Any]]:
    bodies = []
    for prompt in prompts:
        response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                         "temperature": 0, **extra})
        response.raise_for_status()
        bodies.append(response.json())
    return bodies


@pytest.mark.slow
@pytest.mark.parametrize("pair", [("target", "assistant"), ("permutation", "partly")])
def test_temperature_0_text_is_classic_decode_byte_for_byte_at_every_k_and_near_max_tokens(
        gemma: dict[str, Path], tmp_path: Path, pair: tuple[str, str]) -> None:
    target, assistant = gemma[pair[0]], gemma[pair[1]]
    lengths = (24, 1, 2, 3, 5)  # whole rounds, and rounds narrowed by max_tokens
    with _exact_server(target, assistant, tmp_path, MLXCEL_ENABLE_MTP_B1="0") as client:
        classic = {n: [b["choices"][0]["text"] for b in _texts(client, n)] for n in lengths}
    for block in (2, 3, 4):
        with _exact_server(target, assistant, tmp_path, MLXCEL_ENABLE_MTP_B1="1",
                           MLXCEL_DRAFT_BLOCK_SIZE=str(block)) as client:
            policy = client.get("/v1/internal/mtp-policy").json()
            assert (policy["state"], policy["block_size"], policy["target"], policy["drafter"]) == (
                "forced", block, target.name, assistant.name)
            for n in lengths:
                bodies = _texts(client, n)
                assert [b["choices"][0]["text"] for b in bodies] == classic[n], (block, n)
                if n == 24:
                    timings = [b["timings"] for b in bodies]
                    assert all(t["draft_rounds"] > 0 and t["draft_n"] >= t["draft_n_accepted"] for t in timings)
                    if pair[1] == "partly":  # agrees on 60% of tokens: drafts are accepted, not all
                        accepted = sum(t["draft_n_accepted"] for t in timings) / sum(t["draft_n"] for t in timings)
                        assert 0.2 < accepted < 1.0, accepted


@pytest.mark.slow
def test_sampling_through_the_burst_is_seeded_and_reports_its_drafts(gemma: dict[str, Path], tmp_path: Path) -> None:
    with _exact_server(gemma["permutation"], gemma["partly"], tmp_path, MLXCEL_ENABLE_MTP_B1="1",
                       MLXCEL_DRAFT_BLOCK_SIZE="3") as client:
        # Each prompt once first, so that every seeded request below starts from the same prefix-cache hit
        # (a full hit starts the burst with a classic step, which draws from the seed's stream too).
        _texts(client, 1)
        first, again = (_texts(client, 32, temperature=0.8, seed=11) for _ in range(2))
        other = _texts(client, 32, temperature=0.8, seed=12)
    assert [b["choices"] for b in first] == [b["choices"] for b in again]
    assert [b["choices"] for b in first] != [b["choices"] for b in other]
    assert all(b["timings"]["draft_rounds"] > 0 and b["timings"]["draft_n_accepted"] > 0 for b in first)


@pytest.mark.slow
def test_the_policy_profiles_settles_restores_and_reprofiles_a_new_k(gemma: dict[str, Path], tmp_path: Path) -> None:
    env = {"MLXCEL_MTP_PROFILE_SAMPLES": "2", "MLXCEL_DRAFT_BLOCK_SIZE": "4"}
    verdicts = {}
    # The agreeing drafter's enable is timed: rounds enough that the estimate clears the zone. A drafter that is
    # never kept declines from any rounds (a round that adds no token cannot beat a step): fewer tokens.
    for kind, tokens in (("agreeing", 48), ("random", 16)):
        with _exact_server(gemma["permutation"], gemma[kind], tmp_path, **env) as client:
            before = client.get("/v1/internal/mtp-policy").json()
            _texts(client, tokens, PROMPTS[:2])  # the two profiled requests: the policy settles on the second
            verdicts[kind] = client.get("/v1/internal/mtp-policy").json()
        assert (before["state"], before["samples_remaining"], before["drafter"]) == ("profiling", 2, gemma[kind].name)
    agreeing, random = verdicts["agreeing"], verdicts["random"]
    assert (agreeing["state"], agreeing["verdict"], agreeing["acceptance_rate"]) == ("settled", "enable", 1.0)
    assert (random["state"], random["verdict"], random["mtp_enabled"]) == ("settled", "decline", False)
    assert random["acceptance_rate"] < 0.2
    hints = list((tmp_path / "cache" / "mtp-policy").glob("*[!h].json"))  # not *.batch.json
    assert len(hints) == 2
    with _exact_server(gemma["permutation"], gemma["agreeing"], tmp_path, **env) as client:
        assert b1_verdict(client.get("/v1/internal/mtp-policy").json()) == b1_verdict(agreeing)  # restored
    with _exact_server(gemma["permutation"], gemma["agreeing"], tmp_path,
                       **{**env, "MLXCEL_DRAFT_BLOCK_SIZE": "3"}) as client:
        fresh = client.get("/v1/internal/mtp-policy").json()
    assert (fresh["state"], fresh["block_size"], fresh["samples_remaining"]) == ("profiling", 3, 2)


@pytest.mark.slow
async def test_batched_requests_decode_as_they_do_alone_while_the_assistant_is_loaded(
        gemma: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "1")
    prompts = [f"{p} # {i}" for i, p in enumerate(PROMPTS * 2)]
    for target, assistant in (("target", "assistant"), ("permutation", "agreeing")):
        async with running_server(["--model", str(gemma[target]), "--draft-model", str(gemma[assistant])]) as url, \
                httpx.AsyncClient(timeout=120) as client:
            async def complete(prompt: str, into: dict[str, str]) -> None:
                response = await client.post(f"{url}/v1/completions",
                                             json={"prompt": prompt, "max_tokens": 20, "temperature": 0})
                into[prompt] = response.json()["choices"][0]["text"]

            alone: dict[str, str] = {}
            for prompt in prompts:
                await complete(prompt, alone)
            together: dict[str, str] = {}
            async with trio.open_nursery() as nursery:
                for prompt in prompts:
                    nursery.start_soon(complete, prompt, together)
            slots = (await client.get(f"{url}/slots")).json()
        assert together == alone, target
        assert slots is not None


@pytest.mark.requires_openblas  # the inexact wide verify is this BLAS's; CI requires it
async def test_on_openblas_the_gemma_pairing_probes_exact_with_the_row_split(
        gemma: dict[str, Path], caplog: pytest.LogCaptureFixture) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="mlxcel"):
        async with running_server(["--model", str(gemma["target"]), "--draft-model", str(gemma["assistant"]),
                                   "--draft-block-size", "2"]) as url, httpx.AsyncClient(timeout=60) as client:
            policy = (await client.get(f"{url}/v1/internal/mtp-policy")).json()
            body = (await client.post(f"{url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 12,
                                                                      "temperature": 0})).json()
    assert (policy["state"], policy["mtp_enabled"], policy["decline_detail"]) == ("profiling", True, None)
    assert any("at K=2 the burst is byte-identical to classic decode with row-split verify" in r.getMessage()
               for r in caplog.records)
    assert body["timings"]["draft_rounds"] > 0


@pytest.mark.slow
def test_gemma_drafters_that_cannot_be_used_are_refused_at_startup(gemma: dict[str, Path], tmp_path: Path) -> None:
    narrow = tmp_path / "narrow-assistant"
    narrow.mkdir()
    for file in gemma["assistant"].iterdir():
        (narrow / file.name).write_bytes(file.read_bytes())
    config = json.loads((narrow / "config.json").read_text())
    (narrow / "config.json").write_text(json.dumps({**config, "backbone_hidden_size": 32}))
    cases = [
        (["--mtp"], "Gemma 4 checkpoints carry no MTP head: give its assistant with --draft-model DIR"),
        (["--draft-model", str(gemma["permutation"])],
         "is not a Gemma 4 assistant: its config.json says model_type 'gemma4_text'"),
        (["--draft-model", str(narrow)], "was trained for a 32-wide target; gemma4-tiny is 64 wide"),
    ]
    for args, expected in cases:
        stderr = refused("--model", str(gemma["target"]), *args)
        assert expected in stderr and "Traceback" not in stderr, stderr


@pytest.mark.slow
def test_prefixes_a_batch_left_in_the_prefix_cache_serve_the_burst_exactly(gemma: dict[str, Path],
                                                                           tmp_path: Path) -> None:
    """A batch hands its caches to the prefix cache as mlx-lm's own rotating caches; the next request
    adopts them (past the window and the ring: the prompts are 300 tokens) and runs the burst on them.
    Token-id prompts, each follow-up extending exactly what its batched request left cached: the
    continuation, computed here with the model itself (the random target: its text depends on every
    cached key, so a wrongly adopted cache shows)."""
    import concurrent.futures

    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel.checkpoints import inspect_checkpoint, load_checkpoint

    target, assistant = gemma["target"], gemma["assistant"]
    model, tokenizer = load_checkpoint(inspect_checkpoint(target))
    prompts = [[int(t) for t in np.random.default_rng(i).integers(3, 512, 300)] for i in range(3)]
    continuations = []
    for prompt in prompts:
        cache, tokens = make_prompt_cache(model), list(prompt)
        logits = model(mx.array([prompt]), cache=cache)
        for _ in range(8):
            tokens.append(int(mx.argmax(logits[0, -1])))
            logits = model(mx.array([tokens[-1:]]), cache=cache)
        continuations.append(tokens[len(prompt):])

    def run(client: httpx.Client) -> list[str]:
        def complete(prompt: list[int]) -> str:
            response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
            return str(response.json()["choices"][0]["text"])

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:  # together: a batch
            first = list(pool.map(complete, prompts))
        assert first == [tokenizer.decode(c) for c in continuations]
        return first + [complete([*p, *c, 5, 6, 7]) for p, c in zip(prompts, continuations, strict=True)]

    with _exact_server(target, assistant, tmp_path, MLXCEL_ENABLE_MTP_B1="0") as client:
        classic = run(client)
    with _exact_server(target, assistant, tmp_path, MLXCEL_ENABLE_MTP_B1="1",
                       MLXCEL_DRAFT_BLOCK_SIZE="3") as client:
        burst = run(client)
        stats = client.get("/v1/cache/stats").json()
    assert burst == classic
    assert stats["hits"] >= len(prompts), stats


@pytest.mark.slow
async def test_the_batch_speculates_with_the_assistant_and_its_text_is_classic_decodes(
        gemma: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gemma 4 inside the continuous batch: five requests for three places, of different lengths (rows join
    a speculating batch and leave it mid-way), some of their prompts past the sliding window and the ring;
    the assistant agreeing in part, so rows keep different counts. At temperature 0 each text is the one
    MTP-off gives under the same arrivals."""
    import numpy as np

    from tests.server.test_batch_mtp import _at_once, _steps

    lengths = [6, 40, 120, 10, 300]
    requests: list[dict[str, object]] = [
        {"prompt": [int(t) for t in np.random.default_rng(i).integers(3, 512, n)], "max_tokens": 18 + 9 * i,
         "temperature": 0} for i, n in enumerate(lengths)]
    argv = ["--model", str(gemma["permutation"]), "--draft-model", str(gemma["partly"]), "--parallel", "3",
            "--metrics", "--prompt-cache-size", "0"]
    texts, batches, steps = {}, {}, {}
    for pin in ("0", "1"):
        monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", pin)
        monkeypatch.setenv("MLXCEL_CACHE_DIR", str(tmp_path / f"cache-{pin}"))
        async with running_server(argv) as url, httpx.AsyncClient(timeout=120) as client:
            bodies = await _at_once(url, requests, stagger=0.02)
            batches[pin] = (await client.get(f"{url}/v1/internal/mtp-policy")).json()["batch"]
            steps[pin] = await _steps(url)
        texts[pin] = [b["choices"][0]["text"] for b in bodies]  # type: ignore[index]
    assert texts["1"] == texts["0"]
    assert batches["1"]["speculates"] is True and not batches["1"].get("inexact_widths")
    assert sum(n for k, n in steps["1"].items() if k != "0") > 0, steps  # the pinned server's batch drafted
    proposed, accepted = (sum(b["timings"][key] for b in bodies) for key in ("draft_n", "draft_n_accepted"))  # type: ignore[index]
    assert 0 < accepted < proposed  # rows kept different counts: they rolled back apart
