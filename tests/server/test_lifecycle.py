"""The process around the engine: answering while loading, startup failures, shutdown."""

from __future__ import annotations

import json
import logging
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import trio
import trio.testing

from mlxcel.engine.instrument import Hooks
from mlxcel.testing.serving import child_env, free_port, wait_healthy
from tests.conftest import validate_wire
from tests.server.conftest import (
    head_read,
    hold_the_batch_probe,
    mlxcel,
    raw_connection,
    received,
    refused,
    running_server,
    serve_config,
    stoppable_server,
    wait_ready,
)


async def test_policy_answers_worker_not_ready_while_the_model_loads(llama: Path) -> None:
    release = threading.Event()
    held = Hooks(before_load=lambda: release.wait(30))
    async with running_server(["--model", str(llama)], ready=False, instrument=held) as url, \
            httpx.AsyncClient() as client:
        loading = (await client.get(f"{url}/v1/internal/mtp-policy")).json()
        validate_wire(loading)
        assert (loading["state"], loading["reason"], loading["mtp_enabled"]) == (
            "unavailable", "worker_not_ready", None)
        health = await client.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["status"] == "loading"
        assert health.json()["observability"]["mtp_policy"]["status"] == "unavailable"
        early = await client.post(f"{url}/v1/completions", json={"prompt": "x"})
        assert early.status_code == 503 and early.json()["error"]["code"] == "model_loading"

        release.set()
        await wait_ready(url)
        ready = (await client.get(f"{url}/v1/internal/mtp-policy")).json()
        validate_wire(ready)
        assert (ready["state"], ready["reason"], ready["mtp_enabled"]) == ("unavailable", "no_mtp_dispatch", False)
        assert (await client.get(f"{url}/v1/health")).status_code == 200


async def test_health_says_what_a_long_start_is_doing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A large pairing's start takes a minute (weights, the row split's measurement, the exactness probes): while it
    loads, ``/health`` has the line the start logged last, and none once it is ready. (At `mlxcel serve`'s
    default log level, INFO, which an in-process server's test sets itself.)"""
    from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint

    model = build_mtp_checkpoint(tmp_path / "qwen35-start", drafter="aligned", context_scale=0.05)
    probing, release = hold_the_batch_probe(monkeypatch)
    caplog.set_level(logging.INFO, logger="mlxcel")
    try:
        async with running_server(["--model", str(model), "--mtp"], ready=False) as url, \
                httpx.AsyncClient(base_url=url) as client:
            assert await trio.to_thread.run_sync(probing.wait, 30)
            health = await client.get("/health")
            assert (health.status_code, health.json()["status"]) == (503, "loading")
            assert health.json()["loading"] == ("MTP batch exactness probe: checking each batch width 2..5 against "
                                                "the batch's classic steps")
            release.set()
            await wait_ready(url)
            assert "loading" not in (await client.get("/health")).json()
    finally:
        release.set()  # however the test ends, the held start goes on (and the server can stop)


async def test_a_shutdown_during_the_model_load_stops_it_between_slices(
        llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    from mlxcel.serve import run_server

    release = threading.Event()
    shutdown = trio.Event()
    config = serve_config(["--model", str(llama)], instrument=Hooks(before_load=lambda: release.wait(30)))
    with caplog.at_level("INFO", logger="mlxcel"), trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(lambda task_status: run_server(config, shutdown=shutdown, task_status=task_status))
            shutdown.set()  # Ctrl-C / SIGTERM while the worker is about to read the weights
            await trio.testing.wait_all_tasks_blocked()  # the engine was told to stop; the load not begun
            release.set()
    messages = [r.getMessage() for r in caplog.records]
    assert "stopped before the model finished loading" in messages
    assert not any(m.startswith("loaded ") for m in messages)  # it never read all the weights


async def test_no_batch_worker_serves_one_at_a_time_and_has_no_mtp(llama: Path) -> None:
    async with running_server(["--model", str(llama), "--no-batch", "--slots"]) as url, \
            httpx.AsyncClient(timeout=60) as client:
        policy = (await client.get(f"{url}/v1/internal/mtp-policy")).json()
        assert (policy["state"], policy["reason"]) == ("unavailable", "no_mtp_dispatch")
        assert len((await client.get(f"{url}/slots")).json()) == 1
        texts: list[str] = []

        async def ask() -> None:
            r = await client.post(f"{url}/v1/completions",
                                  json={"prompt": "def f(x):", "max_tokens": 8, "temperature": 0})
            texts.append(r.json()["choices"][0]["text"])

        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(ask)
        assert len(texts) == 3 and len(set(texts)) == 1


def _broken_checkpoints(llama: Path, root: Path) -> dict[str, tuple[Path, str]]:
    no_config = root / "no-config"
    shutil.copytree(llama, no_config)
    (no_config / "config.json").unlink()
    unsupported = root / "unsupported"
    shutil.copytree(llama, unsupported)
    config = json.loads((unsupported / "config.json").read_text())
    (unsupported / "config.json").write_text(json.dumps({**config, "model_type": "abacus9000"}))
    truncated = root / "truncated"
    shutil.copytree(llama, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    garbage = root / "garbage"
    shutil.copytree(llama, garbage)
    (garbage / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    return {
        "missing": (root / "nowhere", "does not exist"),
        "no config": (no_config, "has no config.json"),
        "unsupported": (unsupported, "model_type 'abacus9000'"),
        "truncated": (truncated, "is truncated or corrupt"),
        "garbage": (garbage, "is truncated or corrupt"),
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing", "no config", "unsupported", "truncated", "garbage"])
def test_bad_model_directory_exits_2_before_binding(llama: Path, tmp_path: Path, case: str) -> None:
    # The command line's entry point in this process (refused: exit status 2, and serving fails the test): the
    # checkpoint is inspected before anything process-wide. test_startup runs the console script end to end.
    path, expected = _broken_checkpoints(llama, tmp_path)[case]
    stderr = refused("--model", str(path))
    lines = [line for line in stderr.splitlines() if line.startswith("mlxcel serve:")]
    assert len(lines) == 1 and expected in lines[0]
    assert "Running on" not in stderr and "listening" not in stderr


@pytest.mark.slow
@pytest.mark.parametrize(("variable", "value"), [("MLXCEL_DRAFT_BLOCK_SIZE", "abc"),
                                                  ("MLXCEL_MTP_ADAPTIVE", "perhaps"),
                                                  ("MLXCEL_BLAS", "/no/such/libblas.so")])
def test_bad_environment_exits_2(llama: Path, monkeypatch: pytest.MonkeyPatch, variable: str, value: str) -> None:
    if variable == "MLXCEL_BLAS":  # a process chooses its BLAS once (mlxcel.blas): a new interpreter's own choice
        result = mlxcel("serve", "--model", str(llama), "--port", str(free_port()),
                        env={variable: value})
        assert result.returncode == 2
        stderr = result.stderr
    else:  # read as the start begins, before anything process-wide: the command line's entry point in this process
        monkeypatch.setenv(variable, value)
        stderr = refused("--model", str(llama))  # exit status 2
    assert f"mlxcel serve: {variable}={value!r} is not valid" in stderr


@pytest.mark.slow
def test_sigterm_mid_stream_ends_the_stream_cleanly_and_exits_0(llama: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    events: list[str] = []
    with log.open("w") as out, subprocess.Popen(
            [sys.executable, "-m", "mlxcel", "serve", "--model", str(llama), "--port", str(port)],
            stdout=out, stderr=subprocess.STDOUT, env=child_env()) as server:
        try:
            wait_healthy(url, server, 60, log)
            with httpx.Client(timeout=60) as client, client.stream("POST", f"{url}/v1/completions", json={
                    "prompt": "def f(x):", "max_tokens": 4000, "stream": True, "temperature": 0}) as stream:
                for line in stream.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 3:
                            server.send_signal(signal.SIGTERM)
            assert server.wait(timeout=30) == 0
        finally:
            server.kill()
    last = json.loads(events[-1])
    assert last["error"]["message"] == "server shutting down"
    assert "[DONE]" not in events  # cut, not ended: the server is going away (a failed request ends with [DONE])
    assert "received SIGTERM: shutting down" in log.read_text()


async def test_a_second_signal_stops_without_waiting_for_the_graceful_shutdown() -> None:
    """The first SIGINT or SIGTERM asks for a graceful shutdown; a second cancels what it still waits for, and
    neither becomes a KeyboardInterrupt (which ended the process with status 2 and a blank reason)."""
    import os

    from mlxcel.http.signals import until_signalled

    seen: list[str] = []

    async def serve(shutdown: trio.Event) -> None:
        await shutdown.wait()
        seen.append("shutting down")
        try:
            await trio.sleep_forever()  # a graceful shutdown that does not end by itself
        except trio.Cancelled:
            seen.append("cancelled")
            raise

    async def until(count: int) -> None:
        while len(seen) < count:
            await trio.sleep(0.01)  # a signal arrives through trio's wakeup descriptor, not as a task's step

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(until_signalled, serve)
            await trio.testing.wait_all_tasks_blocked()
            os.kill(os.getpid(), signal.SIGTERM)
            await until(1)
            os.kill(os.getpid(), signal.SIGINT)
            await until(2)
    assert seen == ["shutting down", "cancelled"]


async def test_a_request_whose_turn_outlasts_the_graceful_period_still_gets_its_503(llama: Path) -> None:
    """A stop while the worker is in a long turn (a prefill chunk: 9 s of a 1 GB model on one CPU thread) ends
    the request when the turn ends. The listener's graceful period starts only then: counted from the stop, it
    closed the connection first, and the client got no answer at all."""
    import dataclasses

    from mlxcel.serve import ServeConfig

    entered, release = threading.Event(), threading.Event()

    def hold(point: str, request: object) -> None:
        if point == "prefill" and not entered.is_set():
            entered.set()
            release.wait(30)

    config = serve_config(["--model", str(llama)], instrument=Hooks(at=hold))
    assert isinstance(config, ServeConfig)
    config = dataclasses.replace(config, connections=dataclasses.replace(config.connections, graceful_timeout=0.2))
    answers: list[httpx.Response] = []
    with trio.fail_after(60):
        async with stoppable_server(config) as (url, shutdown), trio.open_nursery() as nursery:
            async def ask() -> None:
                async with httpx.AsyncClient(base_url=url, timeout=30) as client:
                    answers.append(await client.post("/v1/completions", json={"prompt": "def f(x):",
                                                                              "max_tokens": 4}))

            nursery.start_soon(ask)
            try:
                await trio.to_thread.run_sync(entered.wait, 30)
                shutdown.set()
                await trio.sleep(1.0)  # five graceful periods, real time: the turn outlasts it
            finally:
                release.set()
    assert [a.status_code for a in answers] == [503]
    assert answers[0].json()["error"]["message"] == "server shutting down"


async def test_requests_whose_bodies_are_still_arriving_at_shutdown_get_a_503(llama: Path) -> None:
    """The report's SIGTERM while 20 clients were uploading 1 MB bodies: those still sending when the graceful
    period ended got no answer at all. A body still arriving when the server stops is a 503 at once, closing the
    connection (it once waited out the 5 s graceful period for the rest of the body)."""
    answers: list[bytes] = []
    with trio.fail_after(60):
        async with stoppable_server(serve_config(["--model", str(llama)])) as (url, shutdown):
            streams = []
            for _ in range(5):
                stream = await raw_connection(url)
                await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json"
                                      b"\r\nContent-Length: 1000000\r\n\r\n" + b'{"prompt": "' + b"x" * 1000)
                streams.append(stream)
            # Nothing in the server can go on: the requests are in their handlers, reading bodies that stop coming.
            await trio.testing.wait_all_tasks_blocked()
            shutdown.set()
            for stream in streams:
                answers.append(await received(stream, head_read))  # within 2 s: well inside the graceful period
                await stream.aclose()
    assert all(answer.startswith(b"HTTP/1.1 503") for answer in answers), answers
    assert all(b"\r\nconnection: close\r\n" in answer.lower() for answer in answers), answers


async def test_an_early_answer_waiting_for_the_rest_of_a_body_goes_out_when_the_server_stops(llama: Path) -> None:
    """An answer before the body has all arrived (here a 401) waits, bounded by the keep-alive timeout, for the rest,
    so that the connection can carry the next request. A stop during that wait ends it: the answer goes out at once
    with ``Connection: close``, where it once waited out the whole timeout (30 s here), past the graceful period."""
    config = serve_config(["--model", str(llama), "--api-key", "k", "--keep-alive-timeout", "30"])
    with trio.fail_after(60):
        async with stoppable_server(config) as (url, shutdown), await raw_connection(url) as stream:
            await stream.send_all(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer wrong\r\n"
                                  b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
            # The 401 waits for the other 99 bytes, which never come: nothing is answered before the stop.
            assert await received(stream, bool, seconds=0.5) == b""
            shutdown.set()
            answer = await received(stream, head_read)
    assert answer.startswith(b"HTTP/1.1 401"), answer
    assert b"\r\nconnection: close\r\n" in answer.lower(), answer
