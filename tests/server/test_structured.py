"""Structured output: ``response_format`` under llguidance's grammar, solo, batched and in the MTP burst.

The oracle for "valid" is ``jsonschema`` (the suite's validator), not the
grammar library: a random model's output must parse as JSON and match the
schema it was asked for.
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

from mlxcel.engine.instrument import Hooks
from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from tests.server.conftest import running_server

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "pet": {"enum": ["cat", "dog", None]}},
    "required": ["name", "age", "pet"], "additionalProperties": False}
AS_PERSON = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
CHAT = [{"role": "user", "content": "Describe a person."}]


async def _chat(client: httpx.AsyncClient, url: str, **body: Any) -> dict[str, Any]:
    response = await client.post(f"{url}/v1/chat/completions",
                                 json={"messages": CHAT, "max_tokens": 60, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def _person(body: dict[str, Any]) -> Any:
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    value = json.loads(choice["message"]["content"])
    jsonschema.validate(value, PERSON)
    return value


SLOW_STREAM = 61
"""max_tokens of the stream the handoff test slows down (so the second request surely comes mid-way)."""


def _slow_stream_steps(point: str, request: Any) -> None:
    if point == "solo_step" and request.max_tokens == SLOW_STREAM:
        time.sleep(0.02)


async def test_json_schema_and_json_object(llama: Path) -> None:
    async with running_server(["--model", str(llama), "--metrics"], instrument=Hooks(at=_slow_stream_steps)) as url, \
            httpx.AsyncClient(timeout=60) as client:
        free = await _chat(client, url)
        with pytest.raises(ValueError):
            json.loads(free["choices"][0]["message"]["content"])  # unconstrained, the model writes no JSON
        person = await _chat(client, url, response_format=AS_PERSON, logprobs=True, top_logprobs=3)
        _person(person)
        # Tokens the grammar excludes have logprob -inf: reported as OpenAI's -9999.0, never as bad JSON.
        tops = [t["logprob"] for e in person["choices"][0]["logprobs"]["content"] for t in e["top_logprobs"]]
        assert -9999.0 in tops and min(tops) >= -9999.0
        # Streamed: the same text.
        streamed = await client.post(f"{url}/v1/chat/completions", json={
            "messages": CHAT, "max_tokens": 60, "temperature": 0, "response_format": AS_PERSON, "stream": True})
        text = "".join(c["delta"].get("content") or "" for line in streamed.text.splitlines()
                       if line.startswith("data: {") for c in json.loads(line[6:])["choices"])
        assert text == person["choices"][0]["message"]["content"]
        # json_object: an object (a sampled one too); completions take response_format as well.
        obj = await _chat(client, url, response_format={"type": "json_object"}, max_tokens=200, temperature=1,
                          seed=3)
        assert obj["choices"][0]["message"]["content"].startswith("{")
        completion = await client.post(f"{url}/v1/completions", json={
            "prompt": "person:", "max_tokens": 60, "temperature": 0, "response_format": AS_PERSON})
        assert completion.status_code == 200
        jsonschema.validate(json.loads(completion.json()["choices"][0]["text"]), PERSON)

        # Batched: three at once (two constrained, one free) each give what they gave alone.
        results: dict[str, Any] = {}

        async def run(name: str, **body: Any) -> None:
            results[name] = (await _chat(client, url, **body))["choices"][0]["message"]["content"]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: run("person", response_format=AS_PERSON))
            nursery.start_soon(lambda: run("free"))
            nursery.start_soon(lambda: run("person2", response_format=AS_PERSON, messages=CHAT * 2))
        assert results["person"] == person["choices"][0]["message"]["content"]
        assert results["free"] == free["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(results["person2"]), PERSON)

        # A constrained stream decoding alone, joined by a second request mid-way: it moves into the batch
        # with its matcher and ends with the same text.
        async def handoffs() -> float:
            metrics = (await client.get(f"{url}/metrics")).text
            return float(next(line.split()[1] for line in metrics.splitlines()
                              if line.startswith("mlxcel_solo_handoffs_total ")))

        before, joined = await handoffs(), ""
        async with client.stream("POST", f"{url}/v1/chat/completions", json={
                "messages": CHAT, "max_tokens": SLOW_STREAM, "temperature": 0, "response_format": AS_PERSON,
                "stream": True}) as response, trio.open_nursery() as nursery:
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        joined += c["delta"].get("content") or ""
                    if joined and not nursery.child_tasks:
                        nursery.start_soon(lambda: run("during", max_tokens=30))
        assert joined == person["choices"][0]["message"]["content"]
        assert results["during"]
        assert await handoffs() > before  # it really moved mid-stream

        for bad in ({"type": "json_schema"}, {"type": "xml"},
                    {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}):
            refused = await client.post(f"{url}/v1/chat/completions", json={"messages": CHAT, "response_format": bad})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "response_format", refused.text


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mtp_checkpoint(tmp_path_factory.mktemp("mtp") / "qwen35-aligned", drafter="aligned",
                                context_scale=0.05)


async def test_constrained_requests_with_mtp_forced_on_match_mtp_off(mtp_target: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    outputs = {}
    for mtp in (False, True):
        if mtp:
            monkeypatch.setenv("MLXCEL_ENABLE_MTP_B1", "1")  # the policy forced on: every eligible request bursts
        async with running_server(["--model", str(mtp_target), *(["--mtp"] if mtp else [])]) as url, \
                httpx.AsyncClient(timeout=120) as client:
            free = await _chat(client, url, max_tokens=16)
            person = await _chat(client, url, response_format=AS_PERSON)
            outputs[mtp] = person["choices"][0]["message"]["content"]
            if mtp:  # both run the burst, the constrained one with its grammar at every verified position
                assert free["timings"]["draft_rounds"] > 0 and person["timings"]["draft_rounds"] > 0
            _person(person)
    assert outputs[True] == outputs[False]
