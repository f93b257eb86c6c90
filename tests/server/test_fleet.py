"""Several models behind one port (``--models``, ``--model-dir``), through real HTTP: scripted checkpoints, each
answering its own script, so which model answered is the text itself."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from mlxcel.testing.tools import build_scripted_checkpoint
from tests.conftest import validate_wire
from tests.server.conftest import (
    raw_connection,
    received,
    refused,
    running_server,
    serve_config,
    stoppable_server,
    wait_ready,
)

SCRIPTS = {"hello": ("Hello", " there", ",", " friend", "."), "bye": ("Bye", " for", " now", "."),
           "third": ("A", " third", " one", ".")}


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fleet")
    built = {name: build_scripted_checkpoint(root / name, script) for name, script in SCRIPTS.items()}
    broken = root / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"')  # cut short
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    return {**built, "broken": broken}


async def _say(client: httpx.AsyncClient, model: str, path: str = "/v1/chat/completions") -> httpx.Response:
    body: dict[str, Any] = {"model": model, "max_tokens": 8, "temperature": 0,
                            "messages": [{"role": "user", "content": "hi"}]}
    return await client.post(path, json=body)


def _text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    body = response.json()
    if body.get("type") == "message":
        return "".join(block["text"] for block in body["content"])
    return str(body["choices"][0]["message"]["content"])


async def _states(client: httpx.AsyncClient) -> dict[str, str]:
    listed = (await client.get("/v1/models")).json()["data"]
    return {m["id"]: m["state"] for m in listed}


async def test_models_load_on_demand_make_room_and_answer_as_alone(scripted: dict[str, Path], tmp_path: Path) -> None:
    file = tmp_path / "models.toml"
    file.write_text(f'''
[[models]]
path = "{scripted["hello"]}"
names = ["hello", "claude-sonnet-*"]
pin = true

[[models]]
path = "{scripted["bye"]}"
names = ["bye", "claude-haiku-*"]

[[models]]
path = "{scripted["third"]}"

[[models]]
path = "{scripted["broken"]}"
names = ["broken"]
''')
    async with running_server(["--models", str(file), "--max-loaded", "2"]) as url, \
            httpx.AsyncClient(base_url=url, timeout=60) as client:
        assert await _states(client) == {"hello": "loaded", "bye": "unloaded", "third": "unloaded",
                                         "broken": "unloaded"}
        assert _text(await _say(client, "claude-haiku-4-5")) == "Bye for now."  # a pattern, loaded on demand
        assert _text(await _say(client, "claude-sonnet-4-5")) == "Hello there, friend."
        assert _text(await _say(client, "default")) == "Hello there, friend."
        assert (await _states(client))["bye"] == "loaded"
        # A third model: at most two loaded, hello pinned, so bye (least recently used, idle) makes room.
        assert _text(await _say(client, "third")) == "A third one."
        assert await _states(client) == {"hello": "loaded", "bye": "unloaded", "third": "loaded",
                                         "broken": "unloaded"}
        # Unloaded and loaded again, it answers the same; through Anthropic's Messages API too.
        assert _text(await _say(client, "claude-haiku-4-5", "/v1/messages")) == "Bye for now."
        assert (await _states(client))["third"] == "unloaded"
        # A checkpoint that cannot load fails alone, with its name and why; the others keep serving.
        broken = await _say(client, "broken")
        assert broken.status_code == 500 and broken.json()["error"]["code"] == "model_load_failed"
        assert "'broken' failed to load" in broken.json()["error"]["message"]
        assert _text(await _say(client, "bye")) == "Bye for now."
        listed = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
        assert listed["broken"]["state"] == "failed" and listed["broken"]["error"]
        assert (await client.get("/v1/models/claude-haiku-4-5")).json()["id"] == "bye"
        # The policy of each model: the default's without ?model=, a model not loaded well-formed and not loaded.
        policies = {name: await client.get("/v1/internal/mtp-policy", params={"model": name} if name else None)
                    for name in ("", "third", "claude-haiku-4-5", "gpt-4o")}
        caches = {name: await client.get("/v1/cache/stats", params={"model": name}) for name in ("bye", "third")}
        # A name nobody answers to: each route's own 404, listing every model.
        openai = await _say(client, "gpt-4o")
        anthropic = await _say(client, "gpt-4o", "/v1/messages")
        health = (await client.get("/health")).json()
    assert openai.status_code == anthropic.status_code == 404
    assert openai.json()["error"]["message"] == ("the model 'gpt-4o' does not exist; this server serves 'hello', "
                                                 "'bye', 'third', 'broken'")
    assert anthropic.json()["error"]["type"] == "not_found_error"
    assert health["status"] == "ok" and health["model"] == "hello" and health["observability"]["blas"]
    assert {m["id"]: m["state"] for m in health["models"]} == {"hello": "loaded", "bye": "loaded",
                                                               "third": "unloaded", "broken": "failed"}
    assert listed["hello"]["weight_bytes"] == sum(f.stat().st_size for f in scripted["hello"].glob("*.safetensors"))
    for name in ("", "third", "claude-haiku-4-5"):
        validate_wire(policies[name].json())
    assert policies[""].json()["reason"] == "no_mtp_dispatch"  # hello, loaded, has no drafter
    assert (policies["third"].json()["reason"], policies["third"].json()["mtp_enabled"]) == ("not_loaded", None)
    assert policies["claude-haiku-4-5"].json()["reason"] == "no_mtp_dispatch"  # bye, loaded at that moment
    assert policies["gpt-4o"].status_code == 404 and policies["gpt-4o"].json()["error"]["code"] == "model_not_found"
    # bye's own prefix cache: unloaded, it wrote its prompts to the disk tier, and loaded again, it read them back.
    assert caches["bye"].json()["lookups"] >= 1 and caches["bye"].json()["disk"]["hits"] >= 1
    assert caches["third"].status_code == 503 and caches["third"].json()["error"]["code"] == "model_not_loaded"


async def test_a_model_dir_serves_every_checkpoint_by_its_layouts_name_and_unloads_idle_ones(
        scripted: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxcel.fleet import asgi

    monkeypatch.setattr(asgi, "PING_AFTER", 0.0)  # a stream's keep-alive begins at once (these loads take ms)
    root = tmp_path / "models"
    (root / "org").mkdir(parents=True)
    (root / "org" / "bye").symlink_to(scripted["bye"], target_is_directory=True)  # LM Studio's ORG/NAME
    (root / "third").symlink_to(scripted["third"], target_is_directory=True)
    async with running_server(["--model", str(scripted["hello"]), "--model-dir", str(root),
                               "--idle-unload", "100ms"]) as url, \
            httpx.AsyncClient(base_url=url, timeout=60) as client:
        assert list(await _states(client)) == ["hello", "org/bye", "third"]
        assert _text(await _say(client, "org/bye")) == "Bye for now."
        assert _text(await _say(client, "third")) == "A third one."
        with trio.fail_after(30):  # idle for 100 ms, each is unloaded (the --model one too: nothing pins it)
            while set((await _states(client)).values()) != {"unloaded"}:
                await trio.sleep(0.02)
        assert _text(await _say(client, "third")) == "A third one."  # and loads again when asked for
        # A stream for a model not loaded begins with keep-alives while it loads, then is the model's own stream.
        with trio.fail_after(30):
            while (await _states(client))["org/bye"] != "unloaded":
                await trio.sleep(0.02)
        openai = await client.post("/v1/chat/completions", json={
            "model": "org/bye", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
        with trio.fail_after(30):
            while (await _states(client))["org/bye"] != "unloaded":
                await trio.sleep(0.02)
        anthropic = await client.post("/v1/messages", json={
            "model": "org/bye", "max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    assert openai.headers["content-type"].startswith("text/event-stream")
    assert openai.text.startswith(": ping\n\n") and openai.text.endswith("data: [DONE]\n\n")
    deltas = [json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
              for line in openai.text.splitlines() if line.startswith("data: {")]
    assert "".join(deltas) == "Bye for now."
    assert anthropic.text.startswith('event: ping\ndata: {"type":"ping"}\n\n')
    assert "event: message_stop" in anthropic.text and "Bye" in anthropic.text


async def test_without_a_key_nothing_is_listed_or_loaded(scripted: dict[str, Path], tmp_path: Path) -> None:
    root = tmp_path / "models"
    root.mkdir()
    (root / "bye").symlink_to(scripted["bye"], target_is_directory=True)
    async with running_server(["--model", str(scripted["hello"]), "--model-dir", str(root), "--api-key", "k"]
                              ) as url, httpx.AsyncClient(base_url=url, timeout=60) as client:
        listed = await client.get("/v1/models")
        asked = await _say(client, "bye")
        anthropic = await _say(client, "bye", "/v1/messages")
        keyed = httpx.AsyncClient(base_url=url, timeout=60, headers={"Authorization": "Bearer k"})
        async with keyed:
            states = await _states(keyed)
    assert (listed.status_code, asked.status_code, anthropic.status_code) == (401, 401, 401)
    assert anthropic.json()["error"]["type"] == "authentication_error"
    assert states == {"hello": "loaded", "bye": "unloaded"}


async def test_the_memory_budget_decides_what_stays_loaded_and_what_cannot_load(
        scripted: dict[str, Path], tmp_path: Path) -> None:
    # Each scripted model is charged its ~0.6 MB of weights and its 1 MiB prefix cache bound: two fit in 3.5 MiB.
    root = tmp_path / "models"
    root.mkdir()
    for name in ("bye", "third"):
        (root / name).symlink_to(scripted[name], target_is_directory=True)
    common = ["--model", str(scripted["hello"]), "--model-dir", str(root), "--prompt-cache-bytes", "1M"]
    async with running_server([*common, "--memory-budget", "3.5M"]) as url, \
            httpx.AsyncClient(base_url=url, timeout=60) as client:
        assert _text(await _say(client, "bye")) == "Bye for now."
        assert await _states(client) == {"hello": "loaded", "bye": "loaded", "third": "unloaded"}
        assert _text(await _say(client, "third")) == "A third one."  # hello is the least recently used
        assert await _states(client) == {"hello": "unloaded", "bye": "loaded", "third": "loaded"}
        memory = (await client.get("/health")).json()["memory"]
        listed = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
        # A request whose sequence may reach 4,000 tokens needs more cache than the budget leaves beside its
        # model: refused at once. One of 1,000 fits once the other model, idle, is unloaded to make room.
        greedy = await client.post("/v1/chat/completions", json={
            "model": "bye", "max_tokens": 4000, "messages": [{"role": "user", "content": "hi"}]})
        roomy = await client.post("/v1/chat/completions", json={
            "model": "bye", "max_tokens": 1000, "messages": [{"role": "user", "content": "hi"}]})
        after = await _states(client)
    assert memory["budget"] == int(3.5 * (1 << 20))
    assert memory["charged"] == listed["bye"]["charged_bytes"] + listed["third"]["charged_bytes"]
    assert memory["free"] == memory["budget"] - memory["charged"] - memory["reserved"] > 0
    assert memory["reserved"] == 0  # no request in flight
    # What a token adds to a sequence's cache, measured at load, is what the checkpoint's shape says: K and V
    # for each layer's KV heads, float32.
    config = json.loads((scripted["bye"] / "config.json").read_text())
    per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * config["head_dim"] * 4
    assert listed["bye"]["cache_bytes"]["per_token"] == per_token
    assert greedy.status_code == 503 and greedy.json()["error"]["code"] == "insufficient_memory"
    assert _text(roomy) == "Bye for now." and after == {"hello": "unloaded", "bye": "loaded", "third": "unloaded"}
    assert listed["third"]["charged_bytes"] == listed["third"]["weight_bytes"] + (1 << 20)
    async with running_server([*common, "--memory-budget", "1M"], ready=False) as url, \
            httpx.AsyncClient(base_url=url, timeout=60) as client:
        too_large = await _say(client, "bye")
        await wait_ready(url)  # the default model's load, failed too, ended: nothing could load, and it answers
        health = await client.get("/health")
    assert too_large.status_code == 503 and too_large.json()["error"]["code"] == "model_too_large"
    assert too_large.json()["error"]["message"].startswith("the model 'bye' needs 1.")
    assert "more than the memory budget of 1.05 MB" in too_large.json()["error"]["message"]
    assert health.status_code == 200  # nothing could load, and the server still answers


async def test_a_lone_model_under_a_memory_budget_reserves_each_requests_cache(scripted: dict[str, Path]) -> None:
    async with running_server(["--model", str(scripted["hello"]), "--prompt-cache-bytes", "1M",
                               "--memory-budget", "2M"]) as url, \
            httpx.AsyncClient(base_url=url, timeout=60) as client:
        small = await _say(client, "hello")
        large = await client.post("/v1/chat/completions", json={
            "max_tokens": 2000, "messages": [{"role": "user", "content": "hi"}]})
        memory = (await client.get("/health")).json()["memory"]
    assert _text(small) == "Hello there, friend."
    assert large.status_code == 503 and large.json()["error"]["code"] == "insufficient_memory"
    assert "more than the memory budget leaves beside this model" in large.json()["error"]["message"]
    assert memory["budget"] == 2 << 20 and memory["reserved"] == 0 and memory["charged"] > 1 << 20


def test_a_lone_model_over_its_memory_budget_is_refused_at_start(scripted: dict[str, Path]) -> None:
    said = refused("--model", str(scripted["hello"]), "--prompt-cache-bytes", "1M", "--memory-budget", "1M")
    assert "needs 1.6" in said and "more than --memory-budget 1.05 MB" in said


async def test_a_body_still_arriving_at_shutdown_gets_a_503(scripted: dict[str, Path], tmp_path: Path) -> None:
    """As one model's server: the front reads a body for its ``model``, and a stop during that read answers 503 at
    once. It once waited on for the rest, and the graceful period closed the connection with no answer."""
    root = tmp_path / "models"
    root.mkdir()
    (root / "bye").symlink_to(scripted["bye"], target_is_directory=True)
    config = serve_config(["--model", str(scripted["hello"]), "--model-dir", str(root)])
    with trio.fail_after(60):
        async with stoppable_server(config) as (url, shutdown), await raw_connection(url) as stream:
            await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
                                  b'\r\nContent-Length: 1000000\r\n\r\n{"model": "bye", "messages": "' + b"x" * 1000)
            # The front reads a body that stops coming: nothing is answered before the stop.
            assert await received(stream, bool, seconds=0.5) == b""
            shutdown.set()
            answer = await received(stream, lambda data: data.endswith(b"}"))  # well inside the graceful period
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503") and b"\r\nconnection: close" in head.lower(), answer
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("server_error", "unavailable")
