"""One request's failure never takes the server down or stalls the others.

A real fault is raised on the worker thread at each place a request is served
(prefill, a solo step, the sampler, the MTP verify, the batch step) through the
worker's test hook; everything else is the real server over real HTTP.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path

import httpx
import pytest
import trio

from mlxcel.engine import GenerationRequest
from mlxcel.engine.instrument import Hooks
from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from tests.server.conftest import running_server

FAULTY_MAX_TOKENS = 13  # the hook picks its victim by this
PROMPT = "def wrap(text, width=70):"
OTHER = "for line in lines:"  # this tiny llama goes on for thousands of tokens after it


class InjectedFault(RuntimeError):
    pass


def fault_at(point: str) -> tuple[list[str], object]:
    """A hook that raises at *point* for the faulty request, and the log of points it saw."""
    seen: list[str] = []

    def hook(where: str, request: GenerationRequest) -> None:
        seen.append(where)
        if where == point and request.max_tokens == FAULTY_MAX_TOKENS:
            raise InjectedFault(f"injected at {where}")

    return seen, hook


async def _complete(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
                    **extra: object) -> httpx.Response:
    return await client.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                              "temperature": 0, **extra})


async def _stream_events(client: httpx.AsyncClient, url: str, body: dict[str, object]) -> list[str]:
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        return [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]


def _assert_server_error(response: httpx.Response) -> None:
    assert response.status_code == 500, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error" and "InjectedFault" in error["message"]


@pytest.mark.slow
@pytest.mark.parametrize("point", ["prefill", "solo_step", "sampler"])
async def test_a_fault_while_decoding_alone_ends_only_that_request(
        llama: Path, point: str, caplog: pytest.LogCaptureFixture) -> None:
    # --no-batch: requests decode alone, one after the other, so the others wait in the queue
    # while the faulty one runs, and must be served correctly after it failed.
    seen, hook = fault_at(point)
    sampled = {"temperature": 1.0, "seed": 7} if point == "sampler" else {}
    async with running_server(["--model", str(llama), "--no-batch"], instrument=Hooks(at=hook)) as url, \
            httpx.AsyncClient(timeout=60) as client:
        expected = (await _complete(client, url, OTHER, 24)).json()["choices"][0]["text"]
        assert len(expected) > 10
        with caplog.at_level(logging.ERROR, logger="mlxcel"):
            async with trio.open_nursery() as nursery:
                results: dict[str, httpx.Response] = {}

                async def run(name: str, prompt: str, max_tokens: int, **extra: object) -> None:
                    results[name] = await _complete(client, url, prompt, max_tokens, **extra)

                nursery.start_soon(functools.partial(run, "faulty", PROMPT, FAULTY_MAX_TOKENS, **sampled))
                await trio.sleep(0.05)
                nursery.start_soon(run, "other", OTHER, 24)
        _assert_server_error(results["faulty"])
        assert results["other"].json()["choices"][0]["text"] == expected
        events = await _stream_events(client, url, {"prompt": PROMPT, "max_tokens": FAULTY_MAX_TOKENS, **sampled})
        assert json.loads(events[-2])["error"]["type"] == "server_error" and events[-1] == "[DONE]"
        assert (await client.get(f"{url}/health")).status_code == 200
        assert (await _complete(client, url, OTHER, 24)).json()["choices"][0]["text"] == expected
    assert point in seen
    failed = [r.getMessage() for r in caplog.records if "failed: InjectedFault" in r.getMessage()]
    # One line per faulty request (the plain and the streamed one), naming the request.
    assert len(failed) == 2 and all(line.startswith("request cmpl-") for line in failed)
    assert failed[0].split()[1] != failed[1].split()[1]


@pytest.mark.slow
async def test_a_failed_batch_step_fails_its_sequences_and_the_batch_is_rebuilt(llama: Path) -> None:
    _, hook = fault_at("batch_step")
    async with running_server(["--model", str(llama), "--parallel", "4"], instrument=Hooks(at=hook)) as url, \
            httpx.AsyncClient(timeout=60) as client:
        alone = [(await _complete(client, url, p, 20)).json()["choices"][0]["text"] for p in (PROMPT, OTHER)]
        responses: dict[str, httpx.Response] = {}

        async def run(name: str, prompt: str, max_tokens: int) -> None:
            responses[name] = await _complete(client, url, prompt, max_tokens)

        # A long stream is decoding when the faulty request joins it in the batch.
        body = {"prompt": OTHER, "max_tokens": 3000, "temperature": 0, "stream": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as stream:
            lines = stream.aiter_lines()
            async for line in lines:
                if line.startswith("data: "):
                    break
            await run("faulty", PROMPT, FAULTY_MAX_TOKENS)
            bystander = [line[6:] async for line in lines if line.startswith("data: ")]
        _assert_server_error(responses["faulty"])
        # It was in the failed step: an error event, then [DONE], long before its 3000 tokens.
        assert json.loads(bystander[-2])["error"]["type"] == "server_error" and bystander[-1] == "[DONE]"
        # The rebuilt batch serves on, with the same text as before.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, "a", PROMPT, 20)
            nursery.start_soon(run, "b", OTHER, 20)
        assert [responses[n].json()["choices"][0]["text"] for n in "ab"] == alone


@pytest.mark.slow
async def test_a_fault_in_the_mtp_verify_ends_only_that_request(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    model = build_mtp_checkpoint(tmp_path / "qwen35-partial", drafter="aligned", context_scale=0.05)
    monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "1")
    monkeypatch.setenv("MLXCEL_DRAFT_BLOCK_SIZE", "2")
    seen, hook = fault_at("verify")
    async with running_server(["--model", str(model), "--mtp"], instrument=Hooks(at=hook)) as url, \
            httpx.AsyncClient(timeout=60) as client:
        before = (await _complete(client, url, OTHER, 30)).json()
        _assert_server_error(await _complete(client, url, PROMPT, FAULTY_MAX_TOKENS))
        after = (await _complete(client, url, OTHER, 30)).json()
        assert (await client.get(f"{url}/health")).status_code == 200
    assert "verify" in seen and before["timings"]["draft_rounds"] > 0
    assert after["choices"][0]["text"] == before["choices"][0]["text"]
    assert after["timings"]["draft_rounds"] > 0  # still bursting after the fault
