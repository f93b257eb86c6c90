"""The router's options: flags, their ``MLXCEL_*`` environment forms, and their checks.

Flags win over the environment. Every problem is one line and exit status 2,
before anything is bound (``UsageError``).
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from ..config import OFF_VALUES, ON_VALUES
from ..http.listener import ConnectionLimits, connection_limits
from ..usage import UsageError
from .placement import PLACEMENT_MODES, PlacementMode

ROLES = ("serving", "router")
#: Serving-node options that mean nothing on a router: given with --node-role router, they are refused.
SERVING_ONLY = {"model": "--model", "mtp": "--mtp", "draft_model": "--draft-model", "props": "--props",
                "slots": "--slots", "metrics": "--metrics", "distributed": "--distributed"}


@dataclass(frozen=True)
class RouterConfig:
    backends: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8080
    api_keys: tuple[str, ...] = ()
    backend_api_key: str | None = None
    placement: PlacementMode = "mtp-aware"
    health_interval: float = 2.0
    probe_timeout: float = 2.0
    show_addresses: bool = False
    max_body_bytes: int = 4 * 1024 * 1024
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    backend_timeout: float = 600.0
    """Seconds a node may send nothing before its request fails (a hung node, not a slow generation)."""
    access_log: bool = False


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("router role (--node-role router; docs/scaling.md)")
    group.add_argument("--node-role", choices=ROLES, default=None,
                       help="serving (default; env MLXCEL_NODE_ROLE) or router: no model, forwards to --backend")
    group.add_argument("--backend", action="append", default=[], metavar="URL",
                       help="a serving node's base URL, http://HOST:PORT (may repeat or be comma-separated; "
                            "env MLXCEL_ROUTER_BACKENDS)")
    group.add_argument("--backend-api-key", default=None, metavar="KEY",
                       help="the key the router presents to the backends (env MLXCEL_ROUTER_BACKEND_API_KEY)")
    group.add_argument("--placement", choices=PLACEMENT_MODES, default="mtp-aware",
                       help="how a node is chosen (default: %(default)s)")
    group.add_argument("--health-interval", type=float, default=2.0, metavar="SECONDS",
                       help="seconds between probes of every backend (default: %(default)s)")
    group.add_argument("--backend-timeout", type=float, default=600.0, metavar="SECONDS",
                       help="a request whose node sends nothing for this long fails (502) and the node leaves "
                            "rotation for a while (default: %(default)s)")
    group.add_argument("--router-stats-verbose", action="store_true",
                       help="/router/stats shows node addresses (env MLXCEL_ROUTER_STATS_VERBOSE)")


def _backend_timeout(seconds: float) -> float:
    if not 0 < seconds <= 24 * 3600:
        raise UsageError(f"--backend-timeout must be a number of seconds above 0 (at most a day), not {seconds:g}")
    return seconds


def _switch(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "").strip().lower()
    if not value or value in OFF_VALUES:
        return False
    if value in ON_VALUES:
        return True
    raise UsageError(f"{name}={value!r} is not valid: expected one of 1/true/yes/on or 0/false/no/off")


def node_role(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> str:
    """``serving`` or ``router``: the flag, else ``MLXCEL_NODE_ROLE``, else serving."""
    env = os.environ if env is None else env
    role = args.node_role or env.get("MLXCEL_NODE_ROLE", "").strip() or "serving"
    if role not in ROLES:
        raise UsageError(f"MLXCEL_NODE_ROLE={role!r} is not valid: expected serving or router")
    if role == "serving" and args.backend:
        raise UsageError("--backend is for --node-role router; a serving node has no backends")
    return role


def parse_backend(url: str) -> str:
    """*url* as ``scheme://host:port`` (no trailing slash); :class:`UsageError` when it is not one."""
    parts = urlsplit(url.strip())
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1 \
            or parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise UsageError(f"backend {url!r} is not a serving node's base URL (expected http://HOST:PORT)")
    return f"{parts.scheme}://{parts.netloc}"


def build_router_config(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> RouterConfig:
    """Check the options for a router and build its config; :class:`UsageError` for the first problem."""
    from ..http.auth import KeyFileError, read_keys

    env = os.environ if env is None else env
    for attribute, flag in SERVING_ONLY.items():
        if getattr(args, attribute, None):
            raise UsageError(f"{flag} is for a serving node; a router (--node-role router) loads no model")
    listed = args.backend or [env.get("MLXCEL_ROUTER_BACKENDS", "")]
    backends = [parse_backend(item) for entry in listed for item in entry.split(",") if item.strip()]
    if not backends:
        raise UsageError("a router needs at least one --backend URL (or MLXCEL_ROUTER_BACKENDS)")
    if len(set(backends)) != len(backends):
        raise UsageError("the same --backend is given twice")
    if not (math.isfinite(args.health_interval) and 0.05 <= args.health_interval <= 3600):
        raise UsageError(f"--health-interval must be from 0.05 to 3600 seconds, not {args.health_interval}")
    try:
        keys = read_keys(args.api_key, args.api_key_file)
    except KeyFileError as exc:
        raise UsageError(str(exc)) from exc
    backend_key = (args.backend_api_key or env.get("MLXCEL_ROUTER_BACKEND_API_KEY", "")).strip() or None
    return RouterConfig(
        backends=tuple(backends), host=args.host, port=args.port, api_keys=keys, backend_api_key=backend_key,
        placement=args.placement, health_interval=args.health_interval,
        probe_timeout=2.0,  # not shorter with the interval: a loaded node answers slowly, and is not down
        show_addresses=args.router_stats_verbose or _switch(env, "MLXCEL_ROUTER_STATS_VERBOSE"),
        max_body_bytes=args.max_body_bytes, connections=connection_limits(args), access_log=args.access_log,
        backend_timeout=_backend_timeout(args.backend_timeout))


