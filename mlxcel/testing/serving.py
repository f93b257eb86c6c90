"""`mlxcel serve` in its own process, as a user starts it: for process-wide settings (the BLAS, signals)
and for the benchmarks, which measure the server a user runs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import httpx

#: A directory whose ``sitecustomize`` prepares a process with it on its PYTHONPATH: torch hidden, transformers'
#: import structure shared (see that module).
CHILD_SITE = Path(__file__).parent / "child_site"
#: The environment variable that module reads the shared structures' file from (its ``STRUCTURES``).
IMPORT_STRUCTURES = "MLXCEL_TEST_IMPORT_STRUCTURES"


def child_env(settings: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a test's ``mlxcel`` child process: this process's, *settings* added, torch hidden.

    The child then imports what a user's install has: the dev extra's torch (there for the parity
    references) costs every child ~2.5 s of start-up that a user's server never spends. Where this
    process shares transformers' import structure (:func:`share_import_structures`), the child reads it.
    """
    env = {**os.environ, **(settings or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(CHILD_SITE), env.get("PYTHONPATH"))))
    return env


def share_import_structures(directory: Path) -> None:
    """Scan transformers' import structure here, once, into a file in *directory*, and name it in this process's
    environment, which :func:`child_env` passes on: each child then reads it instead of scanning ~3,400 files at
    its own start (~0.75 s; ``child_site/sitecustomize.py``). For the tests, whose children number in the dozens;
    a benchmark's servers start as a user's do."""
    import pickle

    import transformers
    from transformers.utils import import_utils

    models = Path(transformers.__file__).parent / "models"
    # The two calls transformers makes at import, with the arguments it passes (each is lru-cached by them):
    # transformers/__init__.py with the folder's Path, transformers/models/__init__.py with its __file__.
    calls = (models, str(models / "__init__.py"))
    shared = {str(call): pickle.dumps(import_utils.create_import_structure_from_path(call)) for call in calls}
    path = directory / "transformers-import-structures.pickle"
    path.write_bytes(pickle.dumps(shared))
    os.environ[IMPORT_STRUCTURES] = str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, process: subprocess.Popen[Any], timeout: float, log: Path,
                 each_poll: Callable[[], object] = lambda: None) -> None:
    """Until *url*'s ``/health`` answers 200; an AssertionError with *log* if *process* exits or *timeout* passes.

    *each_poll* runs before every poll."""
    import time

    deadline = time.monotonic() + timeout
    with httpx.Client() as client:  # one for every poll: each new client parses the whole CA store
        while True:
            each_poll()
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)


@contextmanager
def serve_subprocess(args: Sequence[str], env: dict[str, str], log: Path, start_timeout: float = 120,
                     cwd: Path | None = None) -> Iterator[str]:
    """`mlxcel serve` in its own process (for process-wide settings such as the BLAS); yields its URL.

    *cwd*: the directory it runs in (``python -m`` imports ``mlxcel`` from there first)."""
    port = free_port()
    with log.open("w") as out, subprocess.Popen(
            [sys.executable, "-m", "mlxcel", "serve", "--port", str(port), *args],
            stdout=out, stderr=subprocess.STDOUT, env=child_env(env), cwd=cwd) as process:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, process, start_timeout, log)
            yield url
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)


#: mlx's launcher, installed beside the interpreter.
LAUNCH = Path(sys.executable).parent / "mlx.launch"


#: What mlx's ring backend prints when a port it was given was taken before it could bind it.
RING_PORT_TAKEN = "Couldn't bind socket"


def _yield_the_cores(pid: int, ranks: int) -> None:
    """Once process *pid* has forked its *ranks* children, every thread of it at the lowest priority (Linux;
    elsewhere nothing).

    mlx.launch forwards each rank's output in a thread whose ``select`` also waits for the rank's stdin pipe
    to be writable, which it always is: the thread never blocks, and the launcher holds about a core while
    its ranks run (mlx 0.32, ``_distributed_utils/launch.py``). Not before the ranks exist: a child starts
    at the priority of the thread that forks it. Then the spinning takes only what the ranks and the rest
    of the machine leave idle."""
    with suppress(OSError):
        threads = list(Path(f"/proc/{pid}/task").iterdir())
        if sum(len((thread / "children").read_text().split()) for thread in threads) < ranks:
            return
        for thread in threads:
            with suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, int(thread.name), 19)


@contextmanager
def launched(model: Path, mode: str, log: Path, *extra: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Two ranks of ``mlxcel serve --distributed MODE`` under mlx.launch; yields rank 0's URL and the launcher.

    The ring's ports are free when chosen but handed to other processes to bind, so another test can take
    one first: a launch that fails for that alone is started again on fresh ports (three tries)."""
    for attempt in range(3):
        port, ring = free_port(), free_port()
        command = [str(LAUNCH), "-n", "2", "--backend", "ring", "--starting-port", str(ring), "--",
                   sys.executable, "-m", "mlxcel", "serve", "--model", str(model), "--port", str(port),
                   "--distributed", mode, "--props", *extra]
        # stdin a pipe left open: mlx.launch forwards its stdin to the ranks, and /dev/null would spin it.
        # Its own session, so that cleanup can end the launcher and its ranks together.
        with log.open("wb") as out, subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out,
                                                     stderr=subprocess.STDOUT, env=child_env(),
                                                     start_new_session=True) as launcher:
            url = f"http://127.0.0.1:{port}"
            try:
                try:
                    wait_healthy(url, launcher, 120, log, each_poll=lambda: _yield_the_cores(launcher.pid, 2))
                except AssertionError:
                    if attempt < 2 and RING_PORT_TAKEN in log.read_text(errors="replace"):
                        continue
                    raise
                yield url, launcher
                return
            finally:
                # Whatever is left of the launcher's session (a test that failed midway, a rank that hung).
                with suppress(ProcessLookupError):
                    os.killpg(launcher.pid, signal.SIGTERM)
                launcher.wait(timeout=30)


