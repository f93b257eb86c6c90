"""``mlxcel serve``: one trio nursery that owns the engine and the HTTP server.

    trio.run(main)
    └── nursery
        ├── engine.run()  ── trio.to_thread.run_sync(worker.run): every MLX call, one OS thread
        └── http.listener.serve(app)    ── hypercorn's worker, connections bounded; routes read
                                           Observability, submit to the engine

The port is bound before the model loads, so ``/health`` (503) and the policy
endpoint (``unavailable/worker_not_ready``) answer from the first moment.
SIGINT/SIGTERM stop it gracefully: open streams end with an error event, the
worker returns, the process exits 0.
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass, field

import trio

from . import page
from .engine import WorkerSettings
from .engine.instrument import Instrument
from .fleet.serve import FleetConfig, run_fleet
from .fleet.slot import ModelParts, model_charge
from .http.listener import ConnectionLimits
from .http.listener import serve as serve_http
from .http.signals import until_signalled
from .models.loader import CheckpointInfo
from .server import ServerOptions
from .server.native import wait_for_native_calls

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeConfig:
    checkpoint: CheckpointInfo
    worker: WorkerSettings
    options: ServerOptions
    host: str = "127.0.0.1"
    port: int = 8080
    max_queue_depth: int = 16
    blas: str | None = None
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    access_log: bool = False
    budget: int | None = None
    """``--memory-budget``: the model is charged against it, and each request reserves its sequences' caches."""
    instrument: Instrument | None = field(default=None, compare=False)
    """Tests only: what the worker calls before the load and at its fault points (:mod:`.engine.instrument`)."""


async def run_server(config: ServeConfig | FleetConfig, *, shutdown: trio.Event | None = None,
                     task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until *shutdown* is set (or the task is cancelled). Reports the bound URLs when listening."""
    if isinstance(config, FleetConfig):  # several models: mlxcel/fleet
        await run_fleet(config, shutdown=shutdown, task_status=task_status)
        return
    if shutdown is None:
        shutdown = trio.Event()
    name = config.options.model_name or config.checkpoint.name
    ledger = None
    if config.budget is not None:
        from .server.memory import MemoryLedger

        ledger = MemoryLedger(config.budget)
        ledger.charge(name, model_charge(config.checkpoint, config.worker))
    engine, observability, app = ModelParts(config.checkpoint, config.worker, config.options,
                                            config.max_queue_depth).start(name, config.blas, ledger,
                                                                          config.instrument)

    async def stopped() -> None:
        observability.state = "stopping"
        engine.stop()
        # The listener's graceful period starts when this returns: once the worker has ended every open
        # request. Its turn in progress (a prefill chunk: 9 s of a 1 GB model on one CPU thread) could outlast
        # the period, and the answers would be cut off with their connections. New arrivals meanwhile are 503s;
        # a second signal stops without waiting (http/signals.py).
        await engine.finished.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.run)
        urls = await nursery.start(lambda task_status: serve_http(
            app, bind=f"{config.host}:{config.port}", limits=config.connections,
            max_body_bytes=config.options.max_body_bytes, access_log=config.access_log, shutdown=shutdown,
            ending=stopped, task_status=task_status))
        logger.info("listening on %s", ", ".join(urls))
        logger.info("%s", page.announce(urls))
        task_status.started(urls)
        # The engine ends when the worker returns (after a stop) or fails; the
        # HTTP server ends after its graceful shutdown. Either ends the other.
        await engine.finished.wait()
        shutdown.set()
        nursery.cancel_scope.deadline = trio.current_time() + config.connections.graceful_timeout + 1


def raise_open_file_limit() -> int:
    """Raise the soft open-file limit as far as allowed (each connection is a descriptor); the new soft limit.

    To the hard limit when the kernel accepts it; an unlimited hard limit is
    refused as a soft one on some systems (macOS), so smaller steps follow.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    steps = [] if hard == resource.RLIM_INFINITY else [hard]
    for target in [*steps, 1 << 20, 65536, 10240, 4096]:
        if soft < target and (hard == resource.RLIM_INFINITY or target <= hard):
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                return target
            except (ValueError, OSError):
                continue
    return soft


async def main(config: ServeConfig | FleetConfig) -> None:
    """The process: serve, and turn SIGINT/SIGTERM into a graceful shutdown."""
    logger.info("open-file limit: %d", raise_open_file_limit())
    await until_signalled(lambda shutdown: run_server(config, shutdown=shutdown))
    # A grammar compile a stopping server stopped waiting for is native code on its own thread: the process
    # may not finalize under it.
    await trio.to_thread.run_sync(wait_for_native_calls)
