"""``mlxcel serve --models FILE`` / ``--model-dir DIR``: several models behind one port.

    trio.run(main)
    └── nursery
        ├── Fleet.run: nursery
        │   ├── one task per loaded model: its Engine.run (its own worker thread)
        │   └── the idle unloader (--idle-unload, a table's idle_unload)
        └── http.listener.serve(Fleet)   the shared listener; the front picks each request's model

The default model (the first declared) starts loading at once; the others when first asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from .. import page
from ..http.listener import ConnectionLimits
from ..http.listener import serve as serve_http
from ..policy import PolicySettings
from .catalog import Catalog, ModelEntry
from .front import Fleet
from .slot import Parts

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FleetConfig:
    catalog: Catalog
    build: Callable[[ModelEntry], Parts] = field(compare=False)
    """A model's engine settings and route options from its entry (raises when it cannot be served)."""
    policy: PolicySettings = field(default_factory=PolicySettings)
    """The policy's settings (``MLXCEL_*``): what a model not loaded says its profiling window needs."""
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 1024 * 1024
    max_loaded: int | None = None
    budget: int | None = None
    """``--memory-budget``: the bytes every loaded model's charge must stay within (None: no bound)."""
    idle_unload: float | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    blas: str | None = None
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    access_log: bool = False
    metrics: bool = False
    """``--metrics``: ``GET /metrics`` adds the fleet's memory and model gauges to the default model's."""


async def run_fleet(config: FleetConfig, *, shutdown: trio.Event | None = None,
                    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve until *shutdown* is set (or the task is cancelled). Reports the bound URLs when listening."""
    if shutdown is None:
        shutdown = trio.Event()
    fleet = Fleet(config.catalog, config.build, api_keys=config.api_keys, max_body_bytes=config.max_body_bytes,
                  policy=config.policy, blas=config.blas, max_loaded=config.max_loaded, idle_unload=config.idle_unload,
                  budget=config.budget, metrics=config.metrics)
    async def stopped() -> None:
        fleet.stop()
        await engines_ended(fleet)  # the graceful period from the engines' end, as one model's (mlxcel/serve.py)

    async with trio.open_nursery() as nursery:
        await nursery.start(fleet.run)
        urls = await nursery.start(lambda task_status: serve_http(
            fleet, bind=f"{config.host}:{config.port}", limits=config.connections,
            max_body_bytes=config.max_body_bytes, access_log=config.access_log, shutdown=shutdown,
            ending=stopped, task_status=task_status))
        count = len(config.catalog.entries)
        logger.info("listening on %s, serving %d model%s: %s", ", ".join(urls), count, "s" if count > 1 else "",
                    ", ".join(config.catalog.ids()))
        logger.info("%s", page.announce(urls))
        task_status.started(urls)
        await shutdown.wait()
        await engines_ended(fleet)
        nursery.cancel_scope.deadline = trio.current_time() + config.connections.graceful_timeout + 1


async def engines_ended(fleet: Fleet) -> None:
    """Return once every engine *fleet* started has returned (after ``fleet.stop()``: each open request has had
    its end)."""
    for slot in fleet.slots.values():
        if slot.state in ("loading", "loaded", "unloading"):
            await slot.stopped.wait()
