"""Nodes killed under a router: what a node died with is a 502, never replayed; what never reached a node
moves; nothing hangs; none left is a 503.

The nodes that are stopped or killed are `mlxcel serve` processes. The router, and a node that only answers,
whose processes nothing here touches, run in this process (:func:`router_on_a_thread`,
:func:`tests.server.conftest.server_on_a_thread`): the same servers over the same HTTP, without the interpreter
and imports a process of its own costs.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx
import pytest
import trio

from mlxcel.testing.checkpoints import build_checkpoint
from tests.router.conftest import node_stats, processes, router_args, router_on_a_thread, stats
from tests.server.conftest import server_on_a_thread

pytestmark = pytest.mark.slow
QUICK = {"prompt": "def f(x):", "max_tokens": 8, "temperature": 0}


async def test_killing_nodes_mid_run(tmp_path: Path) -> None:
    model = str(build_checkpoint(tmp_path / "llama", "llama", scale=2.0))
    with processes([(["--model", model, "--slots"], None)] * 2, tmp_path / "logs") as nodes, \
            router_on_a_thread(router_args(nodes, "--health-interval", "60")) as router:
        # Probed once at start: the router learns of the deaths from its requests alone.
        with trio.fail_after(30):
            while not all(n["healthy"] for n in stats(router)["nodes"]):
                await trio.sleep(0.05)
        expected = httpx.post(f"{nodes[0].url}/v1/completions", json=QUICK, timeout=60).json()["choices"][0]["text"]
        long_stream: dict[str, object] = {}
        answers: list[httpx.Response] = []

        async with httpx.AsyncClient(timeout=60) as client, trio.open_nursery() as nursery:
            started = trio.Event()

            async def long_stream_task() -> None:
                body = {"prompt": "def f(x):", "max_tokens": 4000, "temperature": 0, "stream": True}
                async with client.stream("POST", f"{router.url}/v1/completions", json=body) as response:
                    long_stream["node"] = response.headers["x-mlxcel-node"]
                    events = []
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            started.set()
                    long_stream["events"] = events

            async def ask() -> None:
                answers.append(await client.post(f"{router.url}/v1/completions", json=QUICK))

            nursery.start_soon(long_stream_task)
            await started.wait()
            victim = int(str(long_stream["node"]).removeprefix("node-"))
            survivor = 1 - victim
            nodes[victim].process.send_signal(signal.SIGSTOP)  # mid-stream; it still accepts connections (backlog)
            # Requests until one is waiting on the stopped node, before its first byte: several at once,
            # so that the survivor is as loaded as the victim when one of them is placed.
            with trio.fail_after(30):
                for _ in range(5):
                    for _ in range(3):
                        nursery.start_soon(ask)
                    await trio.sleep(0.5)
                    if node_stats(router, f"node-{victim}")["in_flight"] >= 2:
                        break
                assert node_stats(router, f"node-{victim}")["in_flight"] >= 2
            nodes[victim].process.kill()
            nodes[victim].process.wait()
            with trio.fail_after(60):  # nothing hangs
                while not ("events" in long_stream and len(answers) == _asked(nursery, answers)):
                    await trio.sleep(0.05)

        # The requests the victim died with are answered 502 and were not replayed on the survivor: the router
        # cannot know the request was innocent (it may be what killed the node).
        # (Those placed on the survivor were answered there.)
        lost = [a for a in answers if a.status_code != 200]
        assert len(lost) >= 1 and all(a.status_code == 502 for a in lost), [a.status_code for a in answers]
        assert all(a.json()["error"]["code"] == "backend_failed" for a in lost)
        assert "not retried" in lost[0].json()["error"]["message"]
        served = [a for a in answers if a.status_code == 200]
        assert all(a.headers["x-mlxcel-node"] == f"node-{survivor}" for a in served)
        assert all(a.json()["choices"][0]["text"] == expected for a in served)
        # The stream that was under way ends with an error event, without [DONE].
        events = long_stream["events"]
        assert isinstance(events, list) and events[-1] != "[DONE]"
        assert json.loads(events[-1])["error"]["code"] == "backend_failed"
        body = stats(router)
        dead = body["nodes"][victim]
        assert (dead["healthy"], dead["in_flight"]) == (False, 0) and dead["failed"] >= 2
        assert dead["lost"] == len(lost) + 1  # the waiting requests and the stream
        assert body["rerouted"] == 0 and body["nodes"][survivor]["lost"] == 0
        # From now on the survivor takes everything.
        again = httpx.post(f"{router.url}/v1/completions", json=QUICK, timeout=60)
        assert again.status_code == 200 and again.headers["x-mlxcel-node"] == f"node-{survivor}"
        assert again.json()["choices"][0]["text"] == expected

        nodes[survivor].process.kill()
        nodes[survivor].process.wait()
        none_left = httpx.post(f"{router.url}/v1/completions", json=QUICK, timeout=60)
        assert none_left.status_code == 503
        assert none_left.json()["error"]["code"] == "no_backend"
        assert httpx.get(f"{router.url}/health", timeout=10).status_code == 503
        assert stats(router)["rejected"] == 1


async def test_a_request_that_never_reached_a_dead_node_moves_to_another(tmp_path: Path) -> None:
    model = str(build_checkpoint(tmp_path / "llama", "llama", scale=2.0))
    # node-0 is a process, to be killed; node-1, which only answers, the same server in this process.
    with processes([(["--model", model, "--slots"], None)], tmp_path / "logs") as (doomed,), \
            server_on_a_thread(["--model", model, "--slots"], {}) as survivor, \
            router_on_a_thread(["--node-role", "router", "--backend", doomed.url, "--backend", survivor,
                                "--health-interval", "60", "--placement", "round-robin"]) as router:
        with trio.fail_after(30):
            while not all(n["healthy"] for n in stats(router)["nodes"]):
                await trio.sleep(0.05)
        doomed.process.kill()  # idle: the router still believes it healthy (no probe for 60 s)
        doomed.process.wait()
        answers = [httpx.post(f"{router.url}/v1/completions", json=QUICK, timeout=60) for _ in range(2)]
        # Round robin sends one of the two to node-0, whose connection is refused: never delivered, so it moves.
        assert [a.status_code for a in answers] == [200, 200]
        assert {a.headers["x-mlxcel-node"] for a in answers} == {"node-1"}
        body = stats(router)
        assert body["rerouted"] == 1 and body["nodes"][0]["healthy"] is False
        assert (body["nodes"][0]["failed"], body["nodes"][0]["lost"]) == (1, 0)


def _asked(nursery: trio.Nursery, answers: list[httpx.Response]) -> int:
    """How many `ask` tasks were started: those still running plus those answered."""
    running = sum(1 for task in nursery.child_tasks if task.name.endswith("ask"))
    return len(answers) + running
