"""Two ranks of ``mlxcel serve --distributed`` under ``mlx.launch`` on loopback (tests and benchmarks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from tests.server.conftest import free_port, wait_healthy

#: mlx's launcher, installed beside the interpreter.
LAUNCH = Path(sys.executable).parent / "mlx.launch"


@contextmanager
def launched(model: Path, mode: str, log: Path, *extra: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """Two ranks of ``mlxcel serve --distributed MODE`` under mlx.launch; yields rank 0's URL and the launcher."""
    port, ring = free_port(), free_port()
    command = [str(LAUNCH), "-n", "2", "--backend", "ring", "--starting-port", str(ring), "--",
               sys.executable, "-m", "mlxcel", "serve", "--model", str(model), "--port", str(port),
               "--distributed", mode, "--props", *extra]
    # stdin a pipe left open: mlx.launch forwards its stdin to the ranks, and /dev/null would spin it.
    # Its own session, so that cleanup can end the launcher and its ranks together.
    with log.open("wb") as out, subprocess.Popen(command, stdin=subprocess.PIPE, stdout=out,
                                                 stderr=subprocess.STDOUT, env=dict(os.environ),
                                                 start_new_session=True) as launcher:
        url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(url, launcher, 120, log)
            yield url, launcher
        finally:
            # Whatever is left of the launcher's session (a test that failed midway, a rank that hung).
            with suppress(ProcessLookupError):
                os.killpg(launcher.pid, signal.SIGTERM)
            launcher.wait(timeout=30)


