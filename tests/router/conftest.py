"""The router tests' servers: `mlxcel serve` nodes and `mlxcel serve --node-role router`, on loopback, as processes
(:class:`Process`), or a router in this process where nothing touches its process (:func:`router_on_a_thread`)."""

from __future__ import annotations

import functools
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlxcel.families.qwen3_5.tiny import build_mtp_checkpoint
from mlxcel.testing.serving import child_env, free_port, wait_healthy
from tests.server.conftest import loop_on_a_thread

NODE_KEY = "node-secret"
ROUTER_KEY = "router-secret"


class Process:
    """One `mlxcel serve` process on a free loopback port, its output in a log file."""

    def __init__(self, args: Sequence[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with log.open("w") as out:
            self.process = subprocess.Popen([sys.executable, "-m", "mlxcel", "serve", "--port", str(self.port),
                                             *args], stdout=out, stderr=subprocess.STDOUT,
                                            env=child_env(env))

    def wait_healthy(self, timeout: float = 120) -> None:
        wait_healthy(self.url, self.process, timeout, self.log)

    def stop(self) -> None:
        stop_all([self])

    def _signal_stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a test may have stopped it
            self.process.send_signal(signal.SIGTERM)

    def _wait_stopped(self) -> None:
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def stop_all(started: Sequence[Process]) -> None:
    """Stop every one of *started* as SIGTERM does, all at once: each is signalled before any is waited for."""
    for process in started:
        process._signal_stop()
    for process in started:
        process._wait_stopped()


@dataclass(frozen=True)
class Router:
    """A router running in this process: its base URL (what the conftest's helpers read of a router)."""

    url: str


@contextmanager
def router_on_a_thread(argv: Sequence[str]) -> Iterator[Router]:
    """`mlxcel serve --port 0 *argv*` (a router's argv, :func:`router_args`) in this process: its config built
    from the command line as the process builds it, its trio loop on a thread, so that a test may block on
    synchronous requests. Yielded once it listens (its nodes are probed as in a process of its own). Leaving
    the block shuts it down as SIGTERM would."""
    from mlxcel.cli import build_parser
    from mlxcel.router.options import build_router_config
    from mlxcel.router.serve import run_router

    config = build_router_config(build_parser().parse_args(["serve", "--port", "0", *argv]), env={})
    with loop_on_a_thread(functools.partial(run_router, config), "router") as url:
        yield Router(url)


@contextmanager
def processes(specs: Sequence[tuple[Sequence[str], dict[str, str] | None]], logs: Path) -> Iterator[list[Process]]:
    """Start every process at once (their startups overlap), yield them once all are healthy; stop them at once."""
    logs.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        started: list[Process] = []
        stack.callback(stop_all, started)  # however many started
        for i, (args, env) in enumerate(specs):
            started.append(Process(args, logs / f"process-{i}-{time.time_ns()}.log", env))
        for process in started:
            process.wait_healthy()
        yield started


def wait_for_every_node(router: Process | Router, count: int, timeout: float = 60) -> None:
    """Until *router* has probed all *count* nodes healthy: its own /health answers 200 from the first."""
    deadline = time.monotonic() + timeout
    while httpx.get(f"{router.url}/health", timeout=5).json()["healthy_nodes"] < count:
        assert time.monotonic() < deadline, router.log.read_text()
        time.sleep(0.05)


def router_args(nodes: Sequence[Process], *extra: str) -> list[str]:
    return ["--node-role", "router", *[a for node in nodes for a in ("--backend", node.url)], *extra]


def stats(router: Process | Router, key: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body: dict[str, Any] = httpx.get(f"{router.url}/router/stats", headers=headers, timeout=10).json()
    return body


def node_stats(router: Process | Router, node_id: str, key: str | None = None) -> dict[str, Any]:
    (row,) = [n for n in stats(router, key)["nodes"] if n["id"] == node_id]
    return row


def texts(events: list[str]) -> str:
    """The text of a completions stream's events."""
    return "".join(c["text"] for e in events if e.startswith("{") for c in json.loads(e).get("choices", []))


@pytest.fixture(scope="session")
def mtp_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen 3.5 with an in-checkpoint head that always agrees with it (its burst runs and accepts)."""
    return build_mtp_checkpoint(tmp_path_factory.mktemp("router-mtp") / "qwen35-aligned", drafter="aligned",
                                context_scale=0.0, layers=4, hidden=64)
