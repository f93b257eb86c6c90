"""``mlxcel serve --node-role router``: the router process.

    trio.run(main)
    └── nursery
        ├── signal receiver (SIGINT/SIGTERM -> graceful shutdown)
        └── run_router: nursery
            ├── nodes.watch: every backend's /health, policy and load, every --health-interval
            ├── one task per forwarded request (forward.py), cancelled with its client request
            └── http/listener.serve(router app)     the shared listener, connections bounded

No model, no mlx: a test checks that the process never imports it.
"""

from __future__ import annotations

import argparse
import logging

import httpx
import trio

from .. import page
from ..http.listener import serve as serve_http
from ..http.signals import interrupted, until_signalled
from ..usage import UsageError
from .app import RouterOptions, RouterState, create_router_app
from .forward import Forwarder
from .nodes import Node, watch
from .options import RouterConfig, build_router_config
from .placement import Placement

logger = logging.getLogger(__name__)


def backend_client(read_timeout: float) -> httpx.AsyncClient:
    """The client the router speaks to its nodes with.

    A read timeout of *read_timeout* (``--backend-timeout``, 600 s by default)
    between bytes: a generation takes as long as it takes (a non-streamed one
    sends nothing until it ends), and a node that dies resets the connection,
    but one that hangs (stopped, partitioned, its engine stuck) must not hold
    its requests forever: it then leaves rotation (``Node.mark_hung``), since
    its ``/health`` may still answer; a node whose ``/health`` stops answering
    is out sooner, by the probes. Idle connections are dropped after 2 s,
    before a node's own keep-alive timeout (5 s by default) closes them under
    a request.
    """
    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0, read=read_timeout, write=30.0, pool=30.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64,
                                                 keepalive_expiry=2.0),
                             headers={"Accept-Encoding": "identity"})


async def run_router(config: RouterConfig, *, shutdown: trio.Event | None = None,
                     task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Route until *shutdown* is set (or the task is cancelled). Reports the bound URLs when listening."""
    if shutdown is None:
        shutdown = trio.Event()
    nodes = [Node(id=f"node-{i}", url=url) for i, url in enumerate(config.backends)]
    backend_headers = {"Authorization": f"Bearer {config.backend_api_key}"} if config.backend_api_key else {}
    limits = config.connections
    async with backend_client(config.backend_timeout) as client, trio.open_nursery() as nursery:
        probed = trio.Event()
        forwarder = Forwarder(nodes, Placement(config.placement), client, backend_headers)
        state = RouterState(nodes=nodes, forwarder=forwarder, nursery=nursery, probed=probed)
        options = RouterOptions(api_keys=config.api_keys, max_body_bytes=config.max_body_bytes,
                                show_addresses=config.show_addresses)
        app = create_router_app(state, options)
        nursery.start_soon(lambda: watch(nodes, client, backend_headers, interval=config.health_interval,
                                         timeout=config.probe_timeout, first_round=probed))

        async with trio.open_nursery() as http:
            urls = await http.start(lambda task_status: serve_http(
                app, bind=f"{config.host}:{config.port}", limits=limits, max_body_bytes=config.max_body_bytes,
                access_log=config.access_log, shutdown=shutdown, task_status=task_status))
            logger.info("router listening on %s; %d backend(s), placement %s", ", ".join(urls), len(nodes),
                        config.placement)
            logger.info("%s", page.announce(urls))
            task_status.started(urls)
        # The listener has finished its graceful shutdown (open answers ended): stop the probes.
        nursery.cancel_scope.cancel()


async def main(config: RouterConfig) -> None:
    await until_signalled(lambda shutdown: run_router(config, shutdown=shutdown))


def serve_router(args: argparse.Namespace) -> int:
    """The ``mlxcel serve --node-role router`` command; its exit status."""
    import sys

    # httpx logs every request at INFO: the probes alone would be several lines a second.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        config = build_router_config(args)
    except UsageError as exc:
        print(f"mlxcel serve: {exc}", file=sys.stderr)
        return 2
    try:
        trio.run(main, config)
    except BaseException as exc:
        if interrupted(exc):  # a signal after the receiver (mlxcel/http/signals.py)
            return 0
        raise
    return 0
