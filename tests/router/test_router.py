"""The router in front of two real serving nodes: its surface, its keys, streaming, disconnects, no mlx.

The cluster's tests talk HTTP to real processes: two `mlxcel serve` nodes on a
tiny llama (keyed; one with /metrics, one with /slots) and a router with its
own key that presents the nodes' key. Others run a router in this process, in
front of those nodes or of scripted sockets, or its command line's refusals.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from mlxcel.testing.checkpoints import build_checkpoint
from mlxcel.testing.serving import free_port
from tests.router.conftest import (
    NODE_KEY,
    ROUTER_KEY,
    Process,
    node_stats,
    router_args,
    stop_all,
    texts,
    wait_for_every_node,
)
from tests.server.conftest import refused

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {ROUTER_KEY}"}
NODE_AUTH = {"Authorization": f"Bearer {NODE_KEY}"}
GREEDY = {"prompt": "def f(x):", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Process, list[Process]]]:
    root = tmp_path_factory.mktemp("router")
    model = str(build_checkpoint(root / "llama", "llama", scale=2.0))
    logs = root / "logs"
    logs.mkdir()
    with ExitStack() as stack:
        # The three start at once (a node's port is known before it listens): the router's start overlaps the
        # nodes', and it probes them until they serve. They stop at once too.
        started: list[Process] = []
        stack.callback(stop_all, started)
        nodes = [Process(["--model", model, "--api-key", NODE_KEY, flag], logs / f"node-{i}.log")
                 for i, flag in enumerate(("--metrics", "--slots"))]
        started += nodes
        router = Process(router_args(nodes, "--api-key", ROUTER_KEY, "--backend-api-key", NODE_KEY,
                                     "--health-interval", "0.5"), logs / "router.log")
        started.append(router)
        for process in started:
            process.wait_healthy()
        wait_for_every_node(router, len(nodes))
        yield router, nodes


def test_the_router_mounts_its_routes_and_404s_everything_else(cluster: tuple[Process, list[Process]]) -> None:
    router, nodes = cluster
    with httpx.Client(base_url=router.url, headers=AUTH, timeout=30) as client:
        listed = client.get("/v1/models").json()["data"]  # the union of the nodes' lists
        assert [(m["id"], m["names"], m["nodes"]) for m in listed] == [("llama", ["llama"], ["node-0", "node-1"])]
        for path in ("/v1/internal/mtp-policy", "/metrics", "/slots", "/props", "/v1/cache/stats",
                     "/v1/health", "/v1/settings", "/router", "/nope", "/page/nope.js"):
            response = client.get(path)
            assert response.status_code == 404, path
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            assert response.json()["error"]["code"] == "not_found"
        index = client.get("/", headers={})  # public: the page to a browser (tests/page), an index to others
        assert index.json()["name"] == "mlxcel-router" and "/router/stats" in index.json()["endpoints"]
        health = client.get("/health", headers={})  # public, as on a serving node
        assert health.status_code == 200 and health.json()["healthy_nodes"] == 2
        body = client.get("/router/stats")
        assert body.status_code == 200
        # Node addresses are not shown without --router-stats-verbose.
        assert all(f":{node.port}" not in body.text for node in nodes)
        assert body.json()["addresses_redacted"] is True
        assert [(n["id"], n["healthy"], n["policy_state"], n["verdict"]) for n in body.json()["nodes"]] == [
            ("node-0", True, "unavailable", None), ("node-1", True, "unavailable", None)]
        assert client.get("/v1/completions").status_code == 405
        embedded = client.post("/v1/embeddings", json={"model": "llama", "input": "hi"})  # forwarded: a chat model
        assert embedded.status_code == 400 and embedded.json()["error"]["code"] == "model_not_supported"
        assert embedded.headers["X-Mlxcel-Node"] in ("node-0", "node-1")


def test_the_router_has_its_own_keys_and_presents_the_backend_key(cluster: tuple[Process, list[Process]]) -> None:
    router, nodes = cluster
    url = f"{router.url}/v1/completions"
    assert httpx.post(url, json=GREEDY, timeout=30).status_code == 401
    # The nodes' key is not one of the router's.
    wrong = httpx.post(url, json=GREEDY, headers=NODE_AUTH, timeout=30)
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{router.url}/router/stats", timeout=30).status_code == 401
    # The nodes refuse the router's key; the router's answer comes from a node, so it presented theirs.
    assert httpx.post(f"{nodes[0].url}/v1/completions", json=GREEDY, headers=AUTH, timeout=30).status_code == 401
    assert httpx.post(url, json=GREEDY, headers=AUTH, timeout=60).status_code == 200


def test_answers_through_the_router_equal_the_nodes_own(cluster: tuple[Process, list[Process]]) -> None:
    router, nodes = cluster
    direct = httpx.post(f"{nodes[1].url}/v1/completions", json=GREEDY, headers=NODE_AUTH, timeout=60).json()
    routed = httpx.post(f"{router.url}/v1/completions", json=GREEDY, headers=AUTH, timeout=60)
    assert routed.headers["x-mlxcel-node"] in ("node-0", "node-1")
    assert routed.json()["choices"][0]["text"] == direct["choices"][0]["text"]
    with httpx.stream("POST", f"{router.url}/v1/completions", json={**GREEDY, "stream": True}, headers=AUTH,
                      timeout=60) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 3
    assert texts(events) == direct["choices"][0]["text"]
    chat = httpx.post(f"{router.url}/v1/chat/completions", headers=AUTH, timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    # A bad request is the node's own 400, passed through.
    bad = httpx.post(f"{router.url}/v1/completions", json={"prompt": "x", "max_tokens": -1}, headers=AUTH,
                     timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


async def _node_busy(client: httpx.AsyncClient, node: Process) -> int:
    """Requests the node itself says it is decoding: its gateway gauge, or its slots."""
    metrics = await client.get(f"{node.url}/metrics", headers=NODE_AUTH)
    if metrics.status_code == 200:
        (line,) = [x for x in metrics.text.splitlines() if x.startswith("vllm:num_requests_running{")]
        return round(float(line.rsplit(" ", 1)[1]))
    slots = (await client.get(f"{node.url}/slots", headers=NODE_AUTH)).json()
    return sum(1 for slot in slots if slot["is_processing"])


async def test_a_stream_passes_through_while_it_is_generated_and_a_disconnect_cancels_it(
        cluster: tuple[Process, list[Process]]) -> None:
    router, nodes = cluster
    payload = json.dumps({"prompt": "def f(x):", "max_tokens": 4000, "temperature": 0, "stream": True}).encode()
    async with httpx.AsyncClient(timeout=30) as client:
        stream = await trio.open_tcp_stream("127.0.0.1", router.port)
        await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                              b"Authorization: Bearer " + ROUTER_KEY.encode() + b"\r\nContent-Length: "
                              + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        received = b""
        with trio.fail_after(30):
            while b"data: " not in received:
                received += await stream.receive_some()
        node_id = next(line.split(b":", 1)[1].strip().decode() for line in received.split(b"\r\n")
                       if line.lower().startswith(b"x-mlxcel-node:"))
        node = nodes[int(node_id.removeprefix("node-"))]
        # The client has its first event while the node is still generating: nothing waits for the end.
        assert await _node_busy(client, node) == 1
        await stream.aclose()  # the client goes away
        with trio.fail_after(10):
            while await _node_busy(client, node) != 0:
                await trio.sleep(0.05)
        # The node stopped the generation well before its 4000 tokens; the router let go of it.
        row = node_stats(router, node_id, ROUTER_KEY)
        assert row["in_flight"] == 0 and row["healthy"]


def test_the_router_process_never_imports_mlx_and_takes_its_settings_from_the_environment(
        cluster: tuple[Process, list[Process]], tmp_path: Path) -> None:
    _, nodes = cluster
    port = free_port()
    script = textwrap.dedent(f"""
        import os, signal, sys, threading, time
        import httpx

        def check():
            url = "http://127.0.0.1:{port}"
            for _ in range(600):
                try:
                    if httpx.get(url + "/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
            answer = httpx.post(url + "/v1/completions", json={{"prompt": "x", "max_tokens": 3}},
                                headers={{"Authorization": "Bearer {ROUTER_KEY}"}}, timeout=60)
            print(answer.status_code, flush=True)
            print(sorted(m for m in sys.modules if m == "mlx" or m.startswith(("mlx.", "mlx_lm"))), flush=True)
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=check, daemon=True).start()
        from mlxcel.cli import main
        sys.exit(main(["serve", "--port", "{port}", "--api-key", "{ROUTER_KEY}"]))
    """)
    env = {"MLXCEL_NODE_ROLE": "router", "MLXCEL_ROUTER_BACKENDS": ",".join(n.url for n in nodes),
           "MLXCEL_ROUTER_BACKEND_API_KEY": NODE_KEY}
    import os

    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, **env}, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["200", "[]"], result.stderr


@pytest.mark.parametrize(("argv", "env", "expected"), [
    (["--node-role", "router"], {}, "a router needs at least one --backend URL"),
    (["--node-role", "router", "--backend", "ftp://127.0.0.1:1"], {}, "is not a serving node's base URL"),
    (["--node-role", "router", "--backend", "http://127.0.0.1:1/v1"], {}, "is not a serving node's base URL"),
    (["--node-role", "router", "--backend", "http://127.0.0.1:1", "--model", "x"], {},
     "--model is for a serving node"),
    (["--backend", "http://127.0.0.1:1"], {}, "--backend is for --node-role router"),
    ([], {"MLXCEL_NODE_ROLE": "gateway"}, "MLXCEL_NODE_ROLE='gateway' is not valid"),
    (["--node-role", "router", "--backend", "http://127.0.0.1:1"], {"MLXCEL_ROUTER_STATS_VERBOSE": "maybe"},
     "MLXCEL_ROUTER_STATS_VERBOSE='maybe' is not valid"),
])
def test_bad_router_settings_are_one_line_and_exit_2(argv: list[str], env: dict[str, str], expected: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # Refused before anything process-wide: the command line's own entry point in this process (refused()).
    for name in ("MLXCEL_NODE_ROLE", "MLXCEL_ROUTER_BACKENDS", "MLXCEL_ROUTER_STATS_VERBOSE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    stderr = refused(*argv)
    lines = [line for line in stderr.splitlines() if line.startswith("mlxcel")]
    assert len(lines) == 1 and expected in lines[0], stderr
    assert "Traceback" not in stderr


async def test_addresses_are_shown_only_when_asked(cluster: tuple[Process, list[Process]]) -> None:
    from mlxcel.cli import build_parser
    from mlxcel.router.options import build_router_config
    from mlxcel.router.serve import run_router

    _, nodes = cluster
    argv = ["serve", "--port", "0", "--node-role", "router", "--backend", f"{nodes[0].url},{nodes[1].url}",
            "--backend-api-key", NODE_KEY, "--router-stats-verbose"]
    config = build_router_config(build_parser().parse_args(argv), env={})
    async with trio.open_nursery() as nursery, httpx.AsyncClient(timeout=30) as client:
        (url,) = await nursery.start(run_router, config)
        with trio.fail_after(30):
            while (await client.get(f"{url}/health")).status_code != 200:
                await trio.sleep(0.02)
        body = (await client.get(f"{url}/router/stats")).json()
        assert body["addresses_redacted"] is False
        assert [n["address"] for n in body["nodes"]] == [nodes[0].url, nodes[1].url]
        nursery.cancel_scope.cancel()


def test_a_schema_that_used_to_kill_a_node_is_a_400_through_the_router_and_no_node_dies(
        cluster: tuple[Process, list[Process]]) -> None:
    router, nodes = cluster
    defs: dict[str, Any] = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}}
                            for i in range(1000)}
    defs["d1000"] = {"type": "string"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"$defs": defs, "$ref": "#/$defs/d0"}}}}
    answer = httpx.post(f"{router.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert answer.status_code == 400 and "deeper than 128 levels" in answer.json()["error"]["message"]
    assert all(node.process.poll() is None for node in nodes)
    rows = [node_stats(router, f"node-{i}", ROUTER_KEY) for i in range(2)]
    assert all(row["healthy"] and row["lost"] == 0 for row in rows)


async def _in_process_router(nursery: trio.Nursery, *argv: str) -> str:
    from mlxcel.cli import build_parser
    from mlxcel.router.options import build_router_config
    from mlxcel.router.serve import run_router

    config = build_router_config(build_parser().parse_args(["serve", "--port", "0", "--node-role", "router",
                                                            "--health-interval", "0.2", *argv]), env={})
    (url,) = await nursery.start(run_router, config)
    async with httpx.AsyncClient(timeout=30) as client:
        with trio.fail_after(30):
            while (await client.get(f"{url}/health")).status_code != 200:
                await trio.sleep(0.02)
    return str(url)


async def test_a_node_that_refuses_the_routers_own_key_is_a_502_for_a_client_whose_key_was_right(
        cluster: tuple[Process, list[Process]]) -> None:
    _, nodes = cluster
    async with trio.open_nursery() as nursery:
        # /health is public on the nodes, so they look healthy; every generation request is refused.
        url = await _in_process_router(nursery, "--backend", nodes[0].url, "--backend-api-key", "wrong")
        async with httpx.AsyncClient(timeout=30) as client:
            answer = await client.post(f"{url}/v1/completions", json=GREEDY)
        assert answer.status_code == 502 and answer.json()["error"]["code"] == "backend_auth"
        assert "router" in answer.json()["error"]["message"]
        nursery.cancel_scope.cancel()


async def _scripted_node(nursery: trio.Nursery, answers: dict[bytes, bytes | None]) -> str:
    """A socket that speaks just enough HTTP to be a node: /health is 200, each POST path gets its scripted
    raw bytes and then the connection closes (a node dying mid-answer, which a real one does too rarely
    to be timed), or, scripted None, nothing ever (an engine stuck). Everything else is 404."""
    async def serve(stream: trio.SocketStream) -> None:
        async with stream:
            received = b""
            while b"\r\n\r\n" not in received:
                chunk = await stream.receive_some()
                if not chunk:
                    return
                received += chunk
            head, _, body = received.partition(b"\r\n\r\n")
            length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(body) < length:  # all of it: a socket closed with bytes unread resets, losing the answer
                chunk = await stream.receive_some()
                if not chunk:
                    return
                body += chunk
            target = received.split(b" ", 2)[1]
            if target == b"/health":
                await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15"
                                      b"\r\nConnection: close\r\n\r\n{\"status\":\"ok\"}")
            elif target in answers and answers[target] is None:
                await trio.sleep_forever()
            else:
                await stream.send_all(answers.get(target) or b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n"
                                                            b"Connection: close\r\n\r\n")

    listeners = await nursery.start(functools.partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
    return f"http://127.0.0.1:{listeners[0].socket.getsockname()[1]}"


async def test_a_non_streamed_answer_cut_mid_body_is_a_502_and_a_redirect_keeps_its_location() -> None:
    cut = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
           b'{"id": "cmpl-1", "choices": [{"text": "trunc')
    moved = b"HTTP/1.1 307 Temporary Redirect\r\nLocation: /v1/elsewhere\r\nContent-Length: 0\r\n\r\n"
    async with trio.open_nursery() as nursery:
        node = await _scripted_node(nursery, {b"/v1/completions": cut, b"/v1/chat/completions": moved})
        url = await _in_process_router(nursery, "--backend", node)
        async with httpx.AsyncClient(timeout=30) as client:
            answer = await client.post(f"{url}/v1/completions", json=GREEDY)
            assert answer.status_code == 502 and answer.json()["error"]["code"] == "backend_failed"
            stats_body = (await client.get(f"{url}/router/stats")).json()
            assert stats_body["nodes"][0]["lost"] == 1 and stats_body["rerouted"] == 0
            with trio.fail_after(10):  # the probe finds the scripted node healthy again
                while not (await client.get(f"{url}/router/stats")).json()["nodes"][0]["healthy"]:
                    await trio.sleep(0.05)
            redirect = await client.post(f"{url}/v1/chat/completions", json={"messages": []})
            assert redirect.status_code == 307 and redirect.headers["location"] == "/v1/elsewhere"
        nursery.cancel_scope.cancel()


async def test_a_node_that_answers_health_but_never_generates_leaves_rotation_after_a_timeout() -> None:
    served = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\nConnection: close"
              b"\r\n\r\n{}")
    async with trio.open_nursery() as nursery:
        hung = await _scripted_node(nursery, {b"/v1/completions": None})
        good = await _scripted_node(nursery, {b"/v1/completions": served})
        url = await _in_process_router(nursery, "--backend", hung, "--backend", good, "--placement", "round-robin",
                                       "--backend-timeout", "1")
        async with httpx.AsyncClient(timeout=30) as client:
            first = await client.post(f"{url}/v1/completions", json=GREEDY)  # round robin: the hung node
            assert first.status_code == 502 and first.json()["error"]["code"] == "backend_failed"
            with trio.fail_after(10):  # its /health answers 200 to the next probe...
                while not (await client.get(f"{url}/router/stats")).json()["nodes"][0]["healthy"]:
                    await trio.sleep(0.05)
            # ...and still only the other node serves.
            answers = [await client.post(f"{url}/v1/completions", json=GREEDY) for _ in range(3)]
            assert [(a.status_code, a.headers["x-mlxcel-node"]) for a in answers] == [(200, "node-1")] * 3
            row = (await client.get(f"{url}/router/stats")).json()["nodes"][0]
            assert (row["healthy"], row["hung"], row["lost"]) == (True, True, 1)
        nursery.cancel_scope.cancel()


async def test_a_client_reading_a_large_answer_steadily_through_the_router_gets_it_whole() -> None:
    """The report's reader at 974 KB/s lost a large answer at 31.7 MB: the router's --send-timeout covered the
    whole relayed body (one write). It is on progress, as on a node."""
    text = "x" * (8 << 20)
    body = json.dumps({"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": text}]})
    whole = (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
             f"Connection: close\r\n\r\n{body}").encode()
    async with trio.open_nursery() as nursery:
        node = await _scripted_node(nursery, {b"/v1/completions": whole})
        url = await _in_process_router(nursery, "--backend", node, "--send-timeout", "1")
        host, port = url.removeprefix("http://").split(":")
        sock = trio.socket.socket()
        sock.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_RCVBUF, 4096)
        await sock.connect((host, int(port)))
        stream = trio.SocketStream(sock)
        request = json.dumps(GREEDY).encode()
        await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                              b"Connection: close\r\nContent-Length: " + str(len(request)).encode() + b"\r\n\r\n"
                              + request)
        received, started = bytearray(), trio.current_time()
        with trio.fail_after(120):
            while chunk := await stream.receive_some(32768):
                received += chunk
                if len(received) // 32768 != (len(received) - len(chunk)) // 32768:
                    await trio.sleep(0.015)  # at most ~2 MB/s: seconds for the whole answer
        await stream.aclose()
        nursery.cancel_scope.cancel()
    head, _, answer = bytes(received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and trio.current_time() - started > 2, head[:200]
    if b"transfer-encoding: chunked" in head.lower():
        answer = _dechunked(answer)
    assert json.loads(answer)["choices"][0]["text"] == text


async def test_the_router_sends_a_request_to_a_node_that_serves_its_model() -> None:
    def answer(body: dict[str, object]) -> bytes:
        data = json.dumps(body)
        return (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                f"Connection: close\r\n\r\n{data}").encode()

    def node(name: str, names: list[str]) -> dict[bytes, bytes | None]:
        return {b"/v1/models": answer({"object": "list", "data": [{"id": name, "object": "model", "names": names}]}),
                b"/v1/completions": answer({"id": "cmpl-1", "object": "text_completion",
                                            "choices": [{"index": 0, "text": f"from {name}"}]}),
                b"/v1/embeddings": answer({"object": "list", "model": name, "data": []})}

    async with trio.open_nursery() as nursery:
        small = await _scripted_node(nursery, node("small", ["small", "claude-haiku-*"]))
        big = await _scripted_node(nursery, node("big", ["big", "claude-opus-*", "claude-sonnet-*"]))
        embedder = await _scripted_node(nursery, node("embedder", ["embedder", "text-embedding-*"]))
        url = await _in_process_router(nursery, "--backend", small, "--backend", big, "--backend", embedder)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            with trio.fail_after(30):  # until a probe has read every list
                while len((await client.get("/v1/models")).json()["data"]) < 3:
                    await trio.sleep(0.05)
            embedded = await client.post("/v1/embeddings", json={"model": "text-embedding-3-small", "input": "a"})
            texts = {}
            for model in ("claude-haiku-4-5", "claude-opus-4", "big", "small"):
                response = await client.post("/v1/completions", json={**GREEDY, "model": model})
                texts[model] = (response.json()["choices"][0]["text"], response.headers["X-Mlxcel-Node"])
            unknown = await client.post("/v1/completions", json={**GREEDY, "model": "gpt-4o"})
            anyone = await client.post("/v1/completions", json=GREEDY)
        nursery.cancel_scope.cancel()
    assert texts == {"claude-haiku-4-5": ("from small", "node-0"), "claude-opus-4": ("from big", "node-1"),
                     "big": ("from big", "node-1"), "small": ("from small", "node-0")}
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert (embedded.json()["model"], embedded.headers["X-Mlxcel-Node"]) == ("embedder", "node-2")
    assert unknown.json()["error"]["message"] == ("the model 'gpt-4o' does not exist; the nodes serve 'small', "
                                                  "'big', 'embedder'")
    assert anyone.status_code == 200  # no model: any node


def _dechunked(data: bytes) -> bytes:
    """An HTTP/1.1 chunked body's content (a truncated one raises)."""
    out, at = bytearray(), 0
    while True:
        end = data.index(b"\r\n", at)
        size = int(data[at:end].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += data[end + 2:end + 2 + size]
        at = end + 2 + size + 2
