"""Real servers for the HTTP tests: `mlxcel serve`'s own config path, hypercorn on port 0."""

from __future__ import annotations

import dataclasses
import functools
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import trio

from mlxcel.cli import build_parser
from mlxcel.engine.instrument import Instrument
from mlxcel.fleet.serve import FleetConfig
from mlxcel.serve import ServeConfig, run_server
from mlxcel.serve_cli import build_serve_config
from mlxcel.testing.checkpoints import FAMILIES, build_checkpoint
from mlxcel.testing.serving import child_env
from tests import openai_spec

T = TypeVar("T")


class SpecRecorder:
    """ASGI middleware that checks every response of the app it wraps against OpenAI's schemas.

    Installed on every server the tests start in-process (:func:`_openai_spec`),
    so each body and each streamed event the suite's HTTP tests receive is
    validated, whatever client they speak through (httpx, the ``openai``
    package, raw sockets). What breaks a schema is collected, not raised: the
    server answers as it would, and the test fails at teardown.
    """

    def __init__(self, app: Any, found: list[str], checked: list[str]) -> None:
        self.app, self.found, self.checked = app, found, checked

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        start: dict[str, Any] = {}
        body = bytearray()

        async def recording_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                body.extend(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            if start:
                headers = {k.decode().lower(): v.decode() for k, v in start.get("headers", [])}
                method, path, status = scope["method"], scope["path"], start["status"]
                try:
                    self.found += openai_spec.body_problems(method, path, status, headers.get("content-type", ""),
                                                            bytes(body))
                except Exception as exc:  # a body that is not even JSON
                    self.found.append(f"{method} {path}: {type(exc).__name__}: {exc}")
                if openai_spec.response_schema(method, path, status, False) is not None:
                    self.checked.append(f"{method} {path} {status}")


@pytest.fixture(autouse=True)
def _openai_spec(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every in-process server of a test validates its OpenAI responses; the test fails on any violation.

    Yields the list of responses checked (``"METHOD path status"``), for tests that look at the coverage.
    """
    import mlxcel.fleet.slot  # where a serving node's app is made, for one model or a fleet's

    found: list[str] = []
    checked: list[str] = []
    real = mlxcel.fleet.slot.create_app

    def create_app(*args: Any, **kwargs: Any) -> Any:
        app = real(*args, **kwargs)
        app.asgi_app = SpecRecorder(app.asgi_app, found, checked)
        return app

    monkeypatch.setattr(mlxcel.fleet.slot, "create_app", create_app)
    yield checked
    assert not found, "responses that break OpenAI's OpenAPI schemas:\n" + "\n".join(found[:20])


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny checkpoint per family. Weights are scaled up so greedy decoding has no near-ties."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {family: build_checkpoint(root / f"{family}-tiny", family, scale=2.0) for family in FAMILIES}


@pytest.fixture
def llama(checkpoints: dict[str, Path]) -> Path:
    return checkpoints["llama"]


def serve_config(argv: Sequence[str], instrument: Instrument | None = None) -> ServeConfig | FleetConfig:
    args = build_parser().parse_args(["serve", "--port", "0", *argv])
    config = build_serve_config(args)
    if isinstance(config, FleetConfig):  # several models (--models, --model-dir)
        assert instrument is None, "an instrument reaches into one worker: serve one model"
        return config
    return dataclasses.replace(config, instrument=instrument)


@asynccontextmanager
async def running_server(argv: Sequence[str], *, ready: bool = True,
                         instrument: Instrument | None = None) -> AsyncIterator[str]:
    """A real `mlxcel serve` in this process; yields its base URL, stops it on exit.

    *instrument* reaches into its worker (:mod:`mlxcel.engine.instrument`: faults, a held load).
    """
    config = serve_config(argv, instrument)
    async with trio.open_nursery() as nursery:
        (url,) = await nursery.start(run_server, config)
        if ready:
            await wait_ready(url)
        yield url
        nursery.cancel_scope.cancel()


@contextmanager
def server_on_a_thread(argv: Sequence[str], env: Mapping[str, str], ready: bool = True) -> Iterator[str]:
    """:func:`running_server` for a synchronous test: the same in-process server, its trio loop on a thread
    (yielded once it is *ready*, else as soon as it listens).

    *env* is in ``os.environ`` while the server lives (`mlxcel serve` reads its ``MLXCEL_*`` settings as it
    starts). Leaving the block shuts the server down as SIGTERM would: in-flight requests end, the worker
    stops. Cheaper than a server process (no interpreter, no imports) wherever nothing process-wide, such
    as the BLAS, differs from this process's.
    """
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        with loop_on_a_thread(functools.partial(run_server, serve_config(argv)), "server",
                              wait_ready if ready else None) as url:
            yield url


@contextmanager
def loop_on_a_thread(run: Callable[..., Awaitable[object]], what: str,
                     ready: Callable[[str], Awaitable[None]] | None = None) -> Iterator[str]:
    """``run(shutdown=..., task_status=...)`` (a server's trio entry, its config bound: ``run_server``,
    ``run_router``) in a trio loop on a thread of its own; yields the URL it listens on, once *ready* (awaited with
    it) returns. Leaving the block sets its shutdown event, as SIGTERM would, and waits for the loop to end; a
    failure of the loop fails the test, naming *what* it ran."""
    stop, started = threading.Event(), threading.Event()
    state: dict[str, Any] = {}

    async def serve() -> None:
        shutdown = trio.Event()
        async with trio.open_nursery() as nursery:
            (state["url"],) = await nursery.start(functools.partial(run, shutdown=shutdown))
            if ready is not None:
                await ready(state["url"])
            started.set()
            await trio.to_thread.run_sync(stop.wait, abandon_on_cancel=True)
            shutdown.set()

    def loop() -> None:
        try:
            trio.run(serve)
        except BaseException as exc:
            state["error"] = exc
        finally:
            started.set()

    thread = threading.Thread(target=loop, name=f"test-{what}-loop")
    thread.start()
    try:
        started.wait()
        if "error" in state:
            raise AssertionError(f"the {what} did not start") from state["error"]
        yield state["url"]
    finally:
        stop.set()
        thread.join(timeout=60)
    assert not thread.is_alive(), f"the {what} did not stop within 60 s"
    if "error" in state:
        raise AssertionError(f"the {what} failed") from state["error"]


def hold_the_batch_probe(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """The batch's exactness probe held as it begins (the real one runs once released): a start caught mid-way.
    Returns (probing: set when a start reaches it, release: set it to let the start go on)."""
    from mlxcel.engine import exactness

    probing, release = threading.Event(), threading.Event()
    probe = exactness.probe_batch_widths

    def held(*args: Any, **kwargs: Any) -> dict[int, str]:
        probing.set()
        release.wait(30)
        return probe(*args, **kwargs)

    monkeypatch.setattr(exactness, "probe_batch_widths", held)
    return probing, release


async def wait_ready(url: str, timeout: float = 60) -> None:
    async with httpx.AsyncClient() as client:
        with trio.fail_after(timeout):
            while (await client.get(f"{url}/health")).status_code != 200:
                await trio.sleep(0.02)


@asynccontextmanager
async def stoppable_server(config: ServeConfig | FleetConfig) -> AsyncIterator[tuple[str, trio.Event]]:
    """A real `mlxcel serve` of *config* in this process, ready; yields its base URL and the shutdown event a
    signal would set. On exit, the shutdown, and its end waited for."""
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        (url,) = await nursery.start(lambda task_status: run_server(config, shutdown=shutdown,
                                                                      task_status=task_status))
        await wait_ready(url)
        yield url, shutdown
        shutdown.set()


async def raw_connection(url: str) -> trio.SocketStream:
    """A TCP connection to the server at *url*, to write a request byte by byte."""
    host, _, port = url.removeprefix("http://").partition(":")
    return await trio.open_tcp_stream(host, int(port))


async def received(stream: trio.SocketStream, done: Callable[[bytes], bool], seconds: float = 2.0) -> bytes:
    """What *stream* receives until *done* holds of it, the connection closes or *seconds* pass."""
    data = b""
    with trio.move_on_after(seconds):
        while not done(data) and (chunk := await stream.receive_some(65536)):
            data += chunk
    return data


def head_read(data: bytes) -> bool:
    """Whether *data* holds an answer's whole head."""
    return b"\r\n\r\n" in data


def anthropic_client(url: str, key: str = "unused") -> Any:
    """The ``anthropic`` SDK's client for the server at *url*, without retries. The SDK is imported here, not at a
    module's top: its import costs ~3 s, which every xdist worker would pay collecting the module."""
    import anthropic

    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)


def b1_verdict(policy: Mapping[str, object]) -> dict[str, object]:
    """A policy body less its ``batch`` field: what a restart restores of the B=1 verdict. (The rule of K's
    cells say which K it runs now, which a restart learns again: its costs are restored, not its choice.)"""
    return {k: v for k, v in policy.items() if k != "batch"}


def refused(*argv: str, command: str = "serve") -> str:
    """What ``mlxcel COMMAND *argv*`` writes to stderr as it refuses (exit status 2; ``serve``: before binding).

    The command line's own entry point (:func:`mlxcel.cli.main`, what the console script calls), run in
    this process: a refusal is decided before anything process-wide (the BLAS, signals, the port), so a
    new interpreter would add only its imports. Serving instead of refusing fails the test at once.
    """
    import mlxcel.router.serve
    import mlxcel.serve

    def serve(config: object) -> None:
        raise AssertionError(f"mlxcel serve {' '.join(argv)} started serving instead of refusing")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mlxcel.serve, "main", serve)
        patch.setattr(mlxcel.router.serve, "main", serve)  # the router role's
        status, stderr = cli(command, *(["--port", "0"] if command == "serve" else []), *argv)  # argv's own wins
    assert status == 2, stderr
    return stderr


def cli(*argv: str) -> tuple[object, str]:
    """``mlxcel *argv*`` through the command line's own entry point (:func:`mlxcel.cli.main`, what the console
    script calls) in this process: its exit status (argparse's own exits included) and what it wrote to stderr.
    Where nothing process-wide is the subject, a new interpreter would add only its imports."""
    import io
    from contextlib import redirect_stderr

    from mlxcel.cli import main

    with redirect_stderr(io.StringIO()) as written:
        try:
            status: object = main(list(argv))
        except SystemExit as exit:
            status = exit.code
    return status, written.getvalue()


def mlxcel(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run the `mlxcel` command line to completion (this process's environment with *env* added; torch hidden)."""
    return subprocess.run([sys.executable, "-m", "mlxcel", *args], capture_output=True, text=True,
                          env=child_env(env), timeout=timeout, check=False)


async def open_stream(url: str, path: str, body: dict[str, object]) -> trio.SocketStream:
    """POST a streaming request over a raw socket and return once the first event arrived.

    The caller holds the connection and can drop it mid-stream, as a client
    that goes away does.
    """
    import json
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    stream = await trio.open_tcp_stream(parts.hostname or "127.0.0.1", parts.port or 80)
    payload = json.dumps(body).encode()
    await stream.send_all(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: test\r\n"
                          b"Content-Type: application/json\r\nContent-Length: "
                          + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    received = b""
    while b"data: " not in received:
        chunk = await stream.receive_some()
        assert chunk, "the server closed the connection before the first event"
        received += chunk
    return stream


async def stream_interrupted(client: httpx.AsyncClient, url: str, body: dict[str, object],
                             interrupt: Callable[[], Awaitable[T]]) -> tuple[str, T]:
    """Stream a completion, run *interrupt* once its first text arrived, and return the whole text."""
    import json

    text = ""
    result: T | None = None
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
                if result is None:
                    result = await interrupt()
    assert result is not None
    return text, result


HELLO = ("Hello", " there", ",", " friend", ".")
"""The scripted reply of :func:`hello_model`, piece by piece (a token each)."""


#: A real 2 x 2 PNG, base64: an image every check passes (a text-only model then refuses it).
TINY_PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAIAAAACCAIAAAD91JpzAAAAFklEQVR4nGPk5ORkYGBgYmBgYGBgAAABbgAfXn6dLgAAAABJRU5E"
            "rkJggg==")


@pytest.fixture(scope="session")
def hello_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A llama answering every chat with "Hello there, friend." (``mlxcel.testing.tools``)."""
    from mlxcel.testing.tools import build_scripted_checkpoint

    return build_scripted_checkpoint(tmp_path_factory.mktemp("scripted") / "hello", HELLO)


@pytest.fixture(scope="module")
def hello_client(hello_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """One server on :func:`hello_model` for a whole module, and a synchronous client of it."""
    env = {"MLXCEL_CACHE_DIR": str(tmp_path_factory.mktemp("hello-client-cache"))}
    with server_on_a_thread(["--model", str(hello_model)], env) as url, \
            httpx.Client(base_url=url, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def caller_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A llama answering every chat with "Checking." and a Hermes-format call of get_weather for Paris."""
    from mlxcel.testing.tools import build_scripted_checkpoint

    return build_scripted_checkpoint(tmp_path_factory.mktemp("scripted") / "caller")



@pytest.fixture(scope="session")
def cache_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A model of each kind of per-sequence state: a llama's KV cache, which rewinds; Qwen 3.5's gated-delta
    recurrence, Gemma 4's sliding-window ring and Inkling's convolutions, which do not."""
    from mlxcel.families.gemma4 import tiny as gemma4
    from mlxcel.families.inkling import tiny as inkling

    root = tmp_path_factory.mktemp("prompt-cache")
    return {"llama": build_checkpoint(root / "llama", "llama", scale=2.0),
            "qwen3_5": build_checkpoint(root / "qwen3_5", "qwen3_5", scale=2.0),
            "gemma4": gemma4.build_target(root / "gemma4"),
            "inkling": inkling.build_target(root / "inkling", seed=1)}


def read_tool_screenshot(client: Any, source: dict[str, str], max_tokens: int) -> Any:
    """The answer (an ``anthropic`` SDK *client*'s message, at temperature 0) to a conversation in Claude Code's
    shape: asked to look at a screenshot, its Read tool returned the image *source* inside a ``tool_result``."""
    return client.messages.create(model="default", max_tokens=max_tokens, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": "Look at the screenshot."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Read",
                                           "input": {"file_path": "shot.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
            {"type": "image", "source": source}]}]}])
