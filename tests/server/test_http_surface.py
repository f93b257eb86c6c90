"""Routes, the API-key gate, and OpenAI-shaped errors for every kind of bad input."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from tests.conftest import validate_wire
from tests.server.conftest import running_server

KEY = "sk-test-0123456789"


@pytest.mark.parametrize(("flag", "path"), [("--props", "/props"), ("--slots", "/slots"),
                                            ("--metrics", "/metrics")])
async def test_gated_routes_exist_only_with_their_flag(llama: Path, flag: str, path: str) -> None:
    async with running_server(["--model", str(llama)]) as url, httpx.AsyncClient() as client:
        missing = await client.get(url + path)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    async with running_server(["--model", str(llama), flag]) as url, httpx.AsyncClient() as client:
        assert (await client.get(url + path)).status_code == 200


async def test_always_mounted_routes(llama: Path) -> None:
    async with running_server(["--model", str(llama)]) as url, httpx.AsyncClient() as client:
        for path in ("/", "/health", "/v1/health", "/v1/models", "/v1/cache/stats", "/v1/internal/mtp-policy"):
            assert (await client.get(url + path)).status_code == 200, path
        # No alias without /v1.
        assert (await client.get(url + "/internal/mtp-policy")).status_code == 404
        body = (await client.get(url + "/v1/internal/mtp-policy")).json()
        validate_wire(body)
        assert list(body)[:3] == ["schema_version", "state", "reason"]  # documented order kept


async def test_metrics_cover_requests_tokens_queue_batch_and_policy(llama: Path) -> None:
    async with running_server(["--model", str(llama), "--metrics"]) as url, httpx.AsyncClient() as client:
        # Greedy: a sampled end of sequence at the first token (it happened: ~1 run in 100) would leave nothing to
        # count, and one after the first would be counted by the metric (a token the model made) but not by usage.
        body = (await client.post(f"{url}/v1/completions", json={"prompt": "def", "max_tokens": 5,
                                                                  "temperature": 0})).json()
        response = await client.get(f"{url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    generated = body["usage"]["completion_tokens"]
    assert generated == 5 and body["choices"][0]["finish_reason"] == "length"
    for series in ('mlxcel_requests_total{route="/v1/completions",status="200"} 1.0',
                   f"mlxcel_generated_tokens_total {float(generated)}", "mlxcel_queue_depth 0.0", "mlxcel_batch_size",
                   'mlxcel_mtp_policy_state{state="unavailable/no_mtp_dispatch"} 1.0', "mlxcel_mtp_enabled 0.0",
                   "mlxcel_request_seconds_count 1.0"):
        assert series in text, series


async def test_auth_matrix(llama: Path, tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# operators\nsk-from-file\n")
    async with running_server(["--model", str(llama), "--api-key", f"{KEY},sk-other",
                               "--api-key-file", str(key_file), "--metrics"]) as url, \
            httpx.AsyncClient() as client:
        for public in ("/", "/health", "/v1/health"):
            assert (await client.get(url + public)).status_code == 200
        denied = []
        for path in ("/v1/internal/mtp-policy", "/v1/models", "/v1/cache/stats", "/metrics", "/nope"):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"X-Api-Key": "wrong"},
                            {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer"}):
                response = await client.get(url + path, headers=headers)
                assert response.status_code == 401, (path, headers)
                denied.append(response.json())
            for headers in ({"Authorization": f"Bearer {KEY}"}, {"X-Api-Key": "sk-other"},
                            {"authorization": "bearer sk-from-file"}):
                expected = 404 if path == "/nope" else 200
                assert (await client.get(url + path, headers=headers)).status_code == expected
        # Missing and wrong keys cannot be told apart.
        assert all(body == denied[0] for body in denied)
        assert denied[0]["error"]["type"] == "authentication_error"
        post = await client.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert post.status_code == 401


async def test_policy_cli_reads_a_live_server(llama: Path) -> None:
    async with running_server(["--model", str(llama), "--api-key", KEY]) as url:
        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "mlxcel", "policy", "--url", url, *args],
                                  capture_output=True, text=True, timeout=60, check=False)

        ok = await trio.to_thread.run_sync(cli, "--api-key", KEY)
        denied = await trio.to_thread.run_sync(cli)
        as_json = await trio.to_thread.run_sync(lambda: cli("--api-key", KEY, "--json"))
    assert ok.returncode == 0 and ok.stdout == "MTP not available: this server has no MTP drafter\n"
    assert denied.returncode == 1 and "401" in denied.stderr and "API key" in denied.stderr
    assert '"reason": "no_mtp_dispatch"' in as_json.stdout


BAD_REQUESTS = [
    # (path, raw body or JSON, status, code, param)
    ("/v1/completions", b"{not json", 400, "invalid_json", None),
    ("/v1/completions", b"\xff\xfe", 400, "invalid_json", None),
    ("/v1/completions", [1, 2, 3], 400, "invalid_json", None),
    ("/v1/completions", {}, 400, "invalid_request", "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "invalid_request", "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "10"}, 400, "invalid_request", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "invalid_request", "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "invalid_request", "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 3}, 400, "invalid_request", "temperature"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "invalid_request", "stream"),
    ("/v1/completions", {"prompt": "x", "stop": ["a"] * 33}, 400, "invalid_request", "stop"),
    ("/v1/completions", {"prompt": ""}, 400, "invalid_request", "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "invalid_request", "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "unsupported_parameter", "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 17}, 400, "invalid_request", "n"),
    ("/v1/completions", {"prompt": "x", "best_of": 17}, 400, "invalid_request", "best_of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "best_of": 2}, 400,
     "unsupported_parameter", "best_of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]},
     400, "unsupported_parameter", "modalities"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "web_search_options": {}}, 400,
     "unsupported_parameter", "web_search_options"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "invalid_request", "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"x5": 1}}, 400, "invalid_request", "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, 400, "invalid_request", "logit_bias"),
    ("/v1/completions", {"prompt": "x", "min_p": 1.5}, 400, "invalid_request", "min_p"),
    ("/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, "invalid_request", "repetition_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "invalid_request", "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, 400,
     "unsupported_parameter", "echo"),
    ("/v1/models/gpt-9", None, 404, "model_not_found", "model"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model_not_found", "model"),
    ("/v1/completions", {"prompt": "word " * 5000}, 400, "context_length_exceeded", "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 5000}, 400, "context_length_exceeded", "prompt"),
    ("/v1/chat/completions", {"messages": []}, 400, "invalid_request", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "invalid_request",
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     400, "invalid_request", "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "functions": [{"name": "f"}]}, 400, "unsupported_parameter", "functions"),
    ("/v1/completions", {"prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "unsupported_parameter", "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "schema": {"type": "object", "minProperties": "two"}}}}, 400,
     "invalid_request", "response_format"),
]


async def test_every_bad_input_gets_an_openai_shaped_error(llama: Path) -> None:
    async with running_server(["--model", str(llama), "--max-body-bytes", "65536"]) as url, \
            httpx.AsyncClient(timeout=60) as client:
        for path, body, status, code, param in BAD_REQUESTS:
            if body is None:
                response = await client.get(url + path)
            elif isinstance(body, bytes):
                response = await client.post(url + path, content=body,
                                             headers={"Content-Type": "application/json"})
            else:
                response = await client.post(url + path, json=body)
            assert response.status_code == status, (body, response.text)
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert (error["code"], error["param"]) == (code, param), (body, error)
            assert error["message"]

        huge = await client.post(f"{url}/v1/completions", json={"prompt": "x" * 70_000})
        assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
        wrong_method = await client.get(f"{url}/v1/completions")
        assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"
        # After all of that, the server still serves.
        fine = await client.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert fine.status_code == 200


def test_the_http_layer_never_imports_mlx() -> None:
    code = ("import sys, mlxcel.server, mlxcel.serve, mlxcel.engine, mlxcel.policy, mlxcel.client; "
            "print(sorted(m for m in sys.modules if m == 'mlx' or m.startswith(('mlx.', 'mlx_lm'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]"
