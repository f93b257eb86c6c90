"""The router in front of two real serving nodes: its surface, its keys, streaming, disconnects, no mlx.

Every test here talks HTTP to real processes: two `mlxcel serve` nodes on a
tiny llama (keyed; one with /metrics, one with /slots) and a router with its
own key that presents the nodes' key.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from tests.checkpoints import build_checkpoint
from tests.router.conftest import NODE_KEY, ROUTER_KEY, Process, node_stats, processes, router_args, texts
from tests.server.conftest import free_port, mlxcel

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {ROUTER_KEY}"}
NODE_AUTH = {"Authorization": f"Bearer {NODE_KEY}"}
GREEDY = {"prompt": "def f(x):", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Process, list[Process]]]:
    root = tmp_path_factory.mktemp("router")
    model = str(build_checkpoint(root / "llama", "llama", scale=2.0))
    with processes([(["--model", model, "--api-key", NODE_KEY, "--metrics"], None),
                    (["--model", model, "--api-key", NODE_KEY, "--slots"], None)], root / "logs") as nodes, \
            processes([(router_args(nodes, "--api-key", ROUTER_KEY, "--backend-api-key", NODE_KEY,
                                    "--health-interval", "0.5"), None)], root / "logs") as (router,):
        yield router, nodes


def test_the_router_mounts_four_routes_and_404s_everything_else(cluster: tuple[Process, list[Process]]) -> None:
    router, nodes = cluster
    with httpx.Client(base_url=router.url, headers=AUTH, timeout=30) as client:
        for path in ("/v1/models", "/v1/internal/mtp-policy", "/metrics", "/slots", "/props", "/v1/cache/stats",
                     "/", "/v1/health", "/v1/settings", "/router", "/nope"):
            response = client.get(path)
            assert response.status_code == 404, path
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            assert response.json()["error"]["code"] == "not_found"
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
def test_bad_router_settings_are_one_line_and_exit_2(argv: list[str], env: dict[str, str], expected: str) -> None:
    import os

    result = mlxcel("serve", "--port", str(free_port()), *argv, env={**os.environ, **env}, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("mlxcel")]
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert "Traceback" not in result.stderr


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
