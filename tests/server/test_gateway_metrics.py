"""The gauges inference gateways read, on a serving node's /metrics (docs/scaling.md)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import open_stream, running_server

GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
          "vllm:gpu_cache_usage_perc")


async def _gauges(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await client.get(f"{url}/metrics")).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name in GAUGES}
    assert {s.labels["model_name"] for f in text_string_to_metric_families(text) for s in f.samples
            if s.name in GAUGES} == {"llama-tiny"}
    return values


async def test_queued_running_and_kv_cache_gauges_follow_the_load(llama: Path) -> None:
    async with running_server(["--model", str(llama), "--metrics", "--parallel", "1"]) as url, \
            httpx.AsyncClient(timeout=30) as client:
        assert await _gauges(client, url) == dict.fromkeys(GAUGES, 0.0)
        body = {"prompt": "def f(x):", "max_tokens": 4000, "temperature": 0, "stream": True}
        running = await open_stream(url, "/v1/completions", body)
        # A second request waits for the one slot.
        waiting = await trio.open_tcp_stream("127.0.0.1", int(url.rsplit(":", 1)[1]))
        payload = json.dumps(body).encode()
        await waiting.send_all(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                               b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        with trio.fail_after(10):
            while (values := await _gauges(client, url))["vllm:num_requests_waiting"] != 1:
                await trio.sleep(0.02)
        assert values["vllm:num_requests_running"] == 1
        # Tokens held (prompt + decoded so far) over the slot's 4096-token context: above 0, below 1.
        assert 0 < values["vllm:kv_cache_usage_perc"] < 1
        assert values["vllm:gpu_cache_usage_perc"] == values["vllm:kv_cache_usage_perc"]
        await running.aclose()
        await waiting.aclose()
        with trio.fail_after(10):
            while await _gauges(client, url) != dict.fromkeys(GAUGES, 0.0):
                await trio.sleep(0.02)
