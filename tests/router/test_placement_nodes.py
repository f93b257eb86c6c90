"""MTP-aware placement with three real nodes, one of which runs the B=1 burst."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import trio

from tests.router.conftest import node_stats, processes, stats, wait_for_every_node
from tests.server.conftest import server_on_a_thread

pytestmark = pytest.mark.slow
LONE = {"prompt": "def f(x):", "max_tokens": 16, "temperature": 0}


async def test_lone_requests_go_to_the_idle_burst_node_and_other_traffic_elsewhere(
        mtp_target: Path, tmp_path: Path) -> None:
    model = str(mtp_target)
    # The router and the burst node (its MLXCEL_ENABLE_MTP_B1 is process-wide) are processes; node-0 and node-2,
    # plain nodes of the same model, are the same servers in this process (nothing here touches their processes).
    # (A router in this process warned in 1 run of 6: the held stream's client gone, httpx's async generators of
    # the forwarded stream were collected after the router's trio run had ended.)
    burst = (["--model", model, "--mtp", "--draft-block-size", "3", "--slots"], {"MLXCEL_ENABLE_MTP_B1": "1"})
    with server_on_a_thread(["--model", model, "--slots"], {}) as node_0, \
            server_on_a_thread(["--model", model, "--metrics"], {}) as node_2, \
            processes([burst], tmp_path / "logs") as (node_1,), \
            processes([(["--node-role", "router", "--backend", node_0, "--backend", node_1.url, "--backend", node_2,
                         "--health-interval", "0.2"], None)], tmp_path / "logs") as (router,):
        wait_for_every_node(router, 3)
        deadline = time.monotonic() + 30
        while not node_stats(router, "node-1")["runs_burst"]:
            assert time.monotonic() < deadline, stats(router)
            time.sleep(0.05)
        body = stats(router)
        assert [(n["policy_state"], n["runs_burst"]) for n in body["nodes"]] == [
            ("unavailable", False), ("forced", True), ("unavailable", False)]

        for _ in range(3):
            answer = httpx.post(f"{router.url}/v1/completions", json=LONE, timeout=60)
            assert answer.headers["x-mlxcel-node"] == "node-1"
            assert answer.json()["timings"]["draft_rounds"] > 0  # it ran the burst there
        assert stats(router)["decisions"] == {"mtp_idle": 3}

        # While the burst node has a lone request, other traffic goes to the other nodes.
        async with httpx.AsyncClient(timeout=60) as client, trio.open_nursery() as nursery:
            streaming = trio.Event()

            async def hold() -> None:
                held = {"prompt": "def f(x):", "max_tokens": 2000, "temperature": 0, "stream": True}
                async with client.stream("POST", f"{router.url}/v1/completions", json=held) as response:
                    assert response.headers["x-mlxcel-node"] == "node-1"
                    async for _ in response.aiter_lines():
                        streaming.set()

            nursery.start_soon(hold)
            await streaming.wait()
            others: list[str] = []

            async def ask() -> None:
                others.append((await client.post(f"{router.url}/v1/completions", json=LONE)).headers["x-mlxcel-node"])

            async with trio.open_nursery() as asking:
                for _ in range(2):
                    asking.start_soon(ask)
            assert sorted(others) == ["node-0", "node-2"]
            nursery.cancel_scope.cancel()  # the held stream's client goes away
        decisions = stats(router)["decisions"]
        assert decisions == {"mtp_idle": 4, "least_loaded": 2}
