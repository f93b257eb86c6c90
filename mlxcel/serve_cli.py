"""The ``mlxcel serve`` options, and turning them into a :class:`~mlxcel.serve.ServeConfig`.

Everything that can be wrong with the settings is found here, before the port
is bound: a bad environment value, a missing or broken model directory, an
unreadable key file. Each is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .config import DEFAULT_DRAFT_BLOCK_SIZE, ConfigError, EnvConfig, load_env, parse_draft_block_size
from .families.qwen3_5 import BUNDLED_MODEL
from .fleet import MODEL_OPTIONS, CatalogError, parse_duration
from .usage import UsageError

if TYPE_CHECKING:
    from .distributed import World
    from .engine import WorkerSettings
    from .fleet import ModelEntry
    from .fleet.serve import FleetConfig
    from .models.drafters.loader import DrafterSpec
    from .models.loader import CheckpointInfo
    from .serve import ServeConfig
    from .server import ServerOptions

logger = logging.getLogger(__name__)

#: The bundled pairing's block size (``BUNDLED_MODEL``, served when no ``--model`` is given) when
#: neither ``--draft-block-size`` nor the environment names one. On CPU with OpenBLAS a verify of
#: K >= 4 is not byte-exact in one forward and runs in two; K = 2 and 3 measured the same speedup
#: there, and K = 2's estimate sits further from the policy's enable line (docs/default-model.md
#: has the measurements).
BUNDLED_BLOCK_SIZE = 2


def _model_name(value: str) -> str:
    if not value or len(value) > 256 or not value.isprintable() or any(c.isspace() for c in value):
        raise argparse.ArgumentTypeError(f"--served-model-name must be 1 to 256 printable characters without "
                                         f"spaces, not {value!r}")
    return value


def _positive(name: str, low: int = 1, high: int | None = None) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = low - 1
        if number < low or (high is not None and number > high):
            accepted = f">= {low}" if high is None else f"from {low} to {high}"
            raise argparse.ArgumentTypeError(f"{name} must be an integer {accepted}, not {value!r}")
        return number
    return parse


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def _byte_size(value: str) -> int:
    """``--prompt-cache-bytes`` and ``--prompt-cache-disk-bytes``: a number of bytes, or of KiB, MiB, GiB, TiB
    with K, M, G, T (B optional)."""
    text = value.strip().lower().removesuffix("ib").removesuffix("b")
    unit = text[-1] if text and text[-1] in "kmgt" else ""
    try:
        number = float(text[:-1] if unit else text)
    except ValueError:
        number = math.nan
    if not (0 <= number < 1 << 50):
        raise argparse.ArgumentTypeError(f"a size such as 512M or 8G, not {value!r}")
    return int(number * _UNITS[unit])


def default_prompt_cache_bytes() -> int:
    """An eighth of physical memory (1 GiB where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 8
    except (ValueError, OSError, AttributeError):
        return 1 << 30


def default_prompt_cache_disk_bytes(cache_root: Path) -> int:
    """A tenth of the free space where the cache directory is (or would be), at most 64 GiB."""
    place = cache_root
    while not place.exists() and place != place.parent:
        place = place.parent
    try:
        return min(64 << 30, shutil.disk_usage(place).free // 10)
    except OSError:
        return 0


def _seconds(name: str) -> Callable[[str], float]:
    def parse(value: str) -> float:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not (0 < number <= 24 * 3600):
            raise argparse.ArgumentTypeError(f"{name} must be a number of seconds above 0 (at most a day), "
                                             f"not {value!r}")
        return number
    return parse


def _duration(value: str) -> float:
    try:
        return parse_duration(value, "--idle-unload")
    except CatalogError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, help="model directory (default: the bundled model)")
    parser.add_argument("--model-dir", type=Path, action="append", default=[], metavar="DIR",
                        help="serve every checkpoint under DIR by name, loaded when first asked for: plain model "
                             "directories, Hugging Face's hub cache, LM Studio's ORG/NAME folders (repeatable)")
    parser.add_argument("--models", type=Path, metavar="FILE",
                        help="a TOML file of [[models]] tables: path, names (patterns allowed), mtp or draft, pin, "
                             "idle_unload and per-model options (docs/cli.md)")
    parser.add_argument("--max-loaded", type=_positive("--max-loaded"), default=None, metavar="N",
                        help="with several models: at most N loaded at once; the least recently used idle one "
                             "is unloaded to make room (default: no bound)")
    parser.add_argument("--memory-budget", type=_byte_size, default=None, metavar="SIZE",
                        help="what the server may hold, e.g. 24G: each model is charged its weights, its drafter's "
                             "and its prefix cache bound; a model that does not fit unloads idle ones first "
                             "(default: what this machine holds safely, printed at start)")
    parser.add_argument("--memory-wait", type=_seconds("--memory-wait"), default=120.0, metavar="SECONDS",
                        help="under a memory budget, how long a request waits for room for its sequences' caches "
                             "before a 503 (default: %(default)s)")
    parser.add_argument("--idle-unload", type=_duration, default=None, metavar="DURATION",
                        help="with several models: unload one idle this long, e.g. 10m (default: never)")
    drafter = parser.add_mutually_exclusive_group()
    drafter.add_argument("--mtp", action="store_true",
                         help="speculative decoding with the model's own in-checkpoint MTP head (mtp.* tensors)")
    drafter.add_argument("--draft-model", type=Path, metavar="DIR",
                         help="speculative decoding with the MTP drafter in DIR")
    parser.add_argument("--draft-block-size", type=str, default=None, metavar="K",
                        help="MTP verify width K (K-1 drafts per round; default MLXCEL_DRAFT_BLOCK_SIZE, else 4, "
                             "or 2 for the bundled model)")
    parser.add_argument("--draft-quantize", type=int, choices=[4, 8], default=None, metavar="BITS",
                        help="quantize the drafter's linear layers to 4 or 8 bits at load (default: as stored)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=_positive("--port", 0, 65535), default=8080,
                        help="port to bind; 0 picks a free one (default: %(default)s)")
    parser.add_argument("--parallel", type=_positive("--parallel"), default=4,
                        help="sequences decoded together (default: %(default)s)")
    parser.add_argument("--max-queue-depth", type=_positive("--max-queue-depth", 0), default=16,
                        help="requests that may wait for a slot before 503 (default: %(default)s)")
    parser.add_argument("--no-batch", action="store_true",
                        help="one slot: one request at a time, no MTP")
    parser.add_argument("--served-model-name", action="append", type=_model_name, default=[], metavar="NAME",
                        help="a name a request's model may use (repeatable); the first is the one /v1/models lists "
                             "and answers name (default: the model directory's name, which stays accepted)")
    parser.add_argument("--prefill-step-size", type=_positive("--prefill-step-size", 16, 1 << 16), default=512,
                        metavar="TOKENS", help="prompt tokens prefilled per forward; a cancel or a new request is "
                                               "seen between chunks (default: %(default)s)")
    parser.add_argument("--kv-bits", type=int, choices=[4, 8], default=None, metavar="BITS",
                        help="quantize the KV cache to 4 or 8 bits (mlx-lm's quantized cache, group 64): less "
                             "memory per token of context; requests then decode one at a time (default: full "
                             "precision)")
    parser.add_argument("--max-tokens", type=_positive("--max-tokens"), default=512,
                        help="completion length when a request names none (default: %(default)s)")
    parser.add_argument("--prompt-cache-size", type=_positive("--prompt-cache-size", 0), default=None,
                        help="also bound the prompt prefix cache in entries; 0 turns it off (default: no bound "
                             "but --prompt-cache-bytes)")
    parser.add_argument("--prompt-cache-bytes", type=_byte_size, default=None, metavar="SIZE",
                        help="bytes of KV caches the prefix cache may hold, e.g. 512M or 8G (default: an eighth "
                             "of physical memory)")
    parser.add_argument("--prompt-cache-disk-bytes", type=_byte_size, default=None, metavar="SIZE",
                        help="bytes of prompt caches kept on disk, under the cache directory, across restarts; 0 "
                             "turns the disk tier off (default: a tenth of the disk's free space, at most 64G)")
    parser.add_argument("--max-body-bytes", type=_positive("--max-body-bytes"), default=4 * 1024 * 1024,
                        help="largest request body accepted (default: %(default)s)")
    parser.add_argument("--max-connections", type=_positive("--max-connections"), default=1024,
                        help="open HTTP connections at most; at the limit the longest-idle one is closed "
                             "(default: %(default)s, lowered to fit the open-file limit)")
    parser.add_argument("--keep-alive-timeout", type=_seconds("--keep-alive-timeout"), default=5.0,
                        metavar="SECONDS", help="an idle keep-alive connection is closed after this long "
                                                "(default: %(default)s)")
    parser.add_argument("--send-timeout", type=_seconds("--send-timeout"), default=30.0, metavar="SECONDS",
                        help="a client that reads nothing of its answer for this long is disconnected and its "
                             "generation cancelled (default: %(default)s)")
    parser.add_argument("--access-log", action="store_true", help="log every request (hypercorn's access log)")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEYS",
                        help="accepted API key(s), comma-separated; may repeat")
    parser.add_argument("--api-key-file", type=Path, help="file of accepted API keys, one per line")
    parser.add_argument("--props", action="store_true", help="mount GET /props")
    parser.add_argument("--slots", action="store_true", help="mount GET /slots")
    parser.add_argument("--metrics", action="store_true", help="mount GET /metrics (Prometheus)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--distributed", choices=["pipeline", "tensor"], default=None,
                        help="shard the model across the processes mlx.launch started (mlx-lm's pipeline or "
                             "tensor parallelism); rank 0 serves HTTP (docs/scaling.md)")
    from .router.options import add_router_arguments

    add_router_arguments(parser)


def build_serve_config(args: argparse.Namespace) -> ServeConfig | FleetConfig:
    """Validate everything and build the config; :class:`UsageError` for the first problem."""
    from .blas import BlasError, load_fast_blas

    try:
        env = load_env()
        default_block_size = DEFAULT_DRAFT_BLOCK_SIZE if args.model is not None else BUNDLED_BLOCK_SIZE
        chosen_block_size = (parse_draft_block_size("--draft-block-size", args.draft_block_size)
                             if args.draft_block_size is not None else env.draft_block_size)
        blas = load_fast_blas()  # before anything imports mlx
    except (ConfigError, BlasError) as exc:
        raise UsageError(str(exc)) from exc
    logger.info("BLAS: %s", blas)

    from .checkpoints import inspect_checkpoint
    from .http.auth import KeyFileError, read_keys
    from .http.listener import connection_limits
    from .models.loader import CheckpointError, import_mlx_lm
    from .serve import ServeConfig

    try:
        keys = read_keys(args.api_key, args.api_key_file)
    except KeyFileError as exc:
        raise UsageError(str(exc)) from exc
    if args.model_dir or args.models is not None:
        return _fleet_config(args, env, blas, keys, chosen_block_size)
    model = args.model
    if model is None:
        if not (BUNDLED_MODEL / "model.safetensors").is_file():
            raise UsageError("no --model given, and this installation has no bundled default model")
        model = BUNDLED_MODEL
        implied = args.draft_model is None and not args.no_batch
        args.mtp = args.mtp or implied
        logger.info("no --model: serving the bundled default pairing %s%s", BUNDLED_MODEL.name,
                    " with its MTP head (--mtp)" if implied else "")
    try:
        checkpoint = inspect_checkpoint(model)
    except CheckpointError as exc:
        raise UsageError(str(exc)) from exc
    if args.kv_bits is not None and args.distributed:
        raise UsageError("--kv-bits is not supported with --distributed (the other ranks keep full-precision caches)")
    # The checks above need no mlx-lm, so a start they refuse exits at once; what follows (drafters, the
    # group, the load) does: imported here, on this thread, before any other starts.
    import_mlx_lm()
    drafter, block_size = _drafter(args, checkpoint, args.mtp, args.draft_model,
                                   chosen_block_size or default_block_size, chosen_block_size is not None)
    sharding = _join_group(args.distributed, checkpoint) if args.distributed else None
    worker, options = _model_serving(args, env, blas, keys, checkpoint, drafter, block_size,
                                     names=args.served_model_name, sharding=sharding,
                                     budgeted=args.memory_budget is not None)
    if args.memory_budget is not None:  # the model's charge must fit (a fleet's models take turns instead)
        from .fleet.residency import charge, size

        need = charge(checkpoint.weight_bytes, drafter.own_bytes() if drafter else 0, worker.prefix_cache_bytes)
        if need > args.memory_budget:
            raise UsageError(f"{checkpoint.name} needs {size(need)} (weights, drafter, prefix cache bound), more "
                             f"than --memory-budget {size(args.memory_budget)}")
    connections = connection_limits(args)
    return ServeConfig(checkpoint=checkpoint, worker=worker, options=options, host=args.host, port=args.port,
                       budget=args.memory_budget,
                       max_queue_depth=args.max_queue_depth, blas=blas, connections=connections,
                       access_log=args.access_log)


def _fleet_config(args: argparse.Namespace, env: EnvConfig, blas: str, keys: tuple[str, ...],
                  chosen_block_size: int | None) -> FleetConfig:
    """``--model-dir`` / ``--models``: the catalog, checked now, and how each model is built when first asked for."""
    from .checkpoints import inspect_checkpoint
    from .fleet import catalog
    from .fleet.serve import FleetConfig
    from .fleet.slot import ModelParts
    from .http.listener import connection_limits
    from .models.loader import import_mlx_lm

    if args.distributed:
        raise UsageError("--distributed shards one model: it does not combine with --model-dir or --models")
    if args.served_model_name:
        raise UsageError("--served-model-name names one model: with --models, give each model its names there")
    if (args.mtp or args.draft_model is not None) and args.model is None:
        raise UsageError("--mtp and --draft-model apply to --model; with --models, say mtp or draft per model")
    try:
        models = catalog(args.model, args.model_dir, args.models)
    except CatalogError as exc:
        raise UsageError(str(exc)) from exc
    import_mlx_lm()
    available = tuple(models.ids())
    flagged = args.model.resolve() if args.model is not None else None

    def build(entry: ModelEntry) -> ModelParts:
        checkpoint = inspect_checkpoint(entry.path)
        ours = entry.path.resolve() == flagged  # --model: the --mtp / --draft-model flags are its
        chosen = entry.options.get("draft_block_size", chosen_block_size)
        drafter, block_size = _drafter(args, checkpoint, entry.mtp or (ours and args.mtp),
                                       entry.draft or (args.draft_model if ours else None),
                                       chosen or DEFAULT_DRAFT_BLOCK_SIZE, chosen is not None)
        worker, options = _model_serving(args, env, blas, keys, checkpoint, drafter, block_size,
                                         names=entry.exact_names, overrides=entry.options, patterns=entry.patterns,
                                         available=available, budgeted=True)
        return ModelParts(checkpoint, worker, options, args.max_queue_depth)

    logger.info("%d models: %s", len(available), ", ".join(available))
    return FleetConfig(catalog=models, build=build, policy=env.policy, api_keys=keys,
                       max_body_bytes=args.max_body_bytes, max_loaded=args.max_loaded, budget=_budget(args),
                       idle_unload=args.idle_unload, host=args.host, port=args.port, blas=blas,
                       connections=connection_limits(args), access_log=args.access_log)


def _budget(args: argparse.Namespace) -> int:
    """``--memory-budget``, else what this machine holds safely; said in the log either way."""
    from .fleet.residency import size
    from .hardware import default_memory_budget

    if args.memory_budget is not None:
        logger.info("memory budget: %s (--memory-budget)", size(args.memory_budget))
        return int(args.memory_budget)
    budget, how = default_memory_budget()
    logger.info("memory budget: %s, %s (--memory-budget sets another)", size(budget), how)
    return budget


def _drafter(args: argparse.Namespace, checkpoint: CheckpointInfo, mtp: bool, draft_model: Path | None,
             block_size: int, chosen: bool) -> tuple[DrafterSpec | None, int]:
    """The model's drafter (``mtp``: its own head; *draft_model*: a standalone one; neither: None) and K: *block_size*
    when *chosen* (a flag, a table, the environment), else what a standalone drafter's config names, else it."""
    if not (mtp or draft_model is not None):
        if args.draft_block_size is not None:
            logger.warning("--draft-block-size %s has no effect without a drafter (--mtp or --draft-model)",
                           args.draft_block_size)
        return None, block_size
    from .checkpoints import inspect_drafter
    from .models.drafters.loader import DrafterError

    try:
        drafter = inspect_drafter(checkpoint, mtp=mtp, draft_model=draft_model)
    except (DrafterError, OSError) as exc:
        raise UsageError(str(exc)) from exc
    block_size = block_size if chosen else drafter.block_size or block_size
    if args.no_batch:
        # Not refused: a script may pass one flag set to several servers. Said once, not silently dropped.
        logger.warning("--no-batch has no MTP path: %s is ignored and every request decodes classically",
                       "--mtp" if mtp else "--draft-model")
        return None, block_size
    logger.info("MTP drafter: %s (K=%d)", drafter.name, block_size)
    return drafter, block_size


def _model_serving(args: argparse.Namespace, env: EnvConfig, blas: str, keys: tuple[str, ...],
                   checkpoint: CheckpointInfo, drafter: DrafterSpec | None, block_size: int, *, names: Sequence[str],
                   sharding: World | None = None, overrides: Mapping[str, int] | None = None,
                   patterns: tuple[str, ...] = (), available: tuple[str, ...] = (), budgeted: bool = False
                   ) -> tuple[WorkerSettings, ServerOptions]:
    """How one model is served: its worker's settings and its routes' options, from the flags, and *overrides*
    (a ``--models`` table's own options, by their flag names with ``_``)."""
    from .engine import WorkerSettings
    from .server import ServerOptions

    option = {**{key: getattr(args, key) for key in MODEL_OPTIONS}, **(overrides or {})}
    # Sharded: one sequence at a time, and no prefix cache, since the other ranks mirror one cache.
    parallel = 1 if args.no_batch or sharding else option["parallel"]
    worker = WorkerSettings(parallel=parallel, batch=not args.no_batch,
                            prefix_cache_entries=0 if sharding else args.prompt_cache_size,
                            prefix_cache_bytes=default_prompt_cache_bytes() if args.prompt_cache_bytes is None
                            else args.prompt_cache_bytes,
                            prefix_cache_disk_bytes=default_prompt_cache_disk_bytes(env.cache_root)
                            if args.prompt_cache_disk_bytes is None else args.prompt_cache_disk_bytes,
                            policy=env.policy,
                            cache_root=env.cache_root, drafter=drafter, block_size=block_size,
                            draft_quantize=args.draft_quantize, sharding=sharding,
                            prefill_step_size=option["prefill_step_size"], kv_bits=option["kv_bits"],
                            measure_kv=budgeted)
    # The first served name is the model's; the others and the directory's name are accepted too.
    name, *aliases = dict.fromkeys([*names, checkpoint.name])
    options = ServerOptions(
        model_name=name, aliases=tuple(aliases), patterns=patterns, available=available,
        model_path=checkpoint.path, context_length=checkpoint.context_length,
        parallel=parallel, default_max_tokens=option["max_tokens"], api_keys=keys,
        max_body_bytes=args.max_body_bytes, props=args.props, slots=args.slots, metrics=args.metrics,
        extra_props={"blas": blas, "draft_block_size": block_size, "pid": os.getpid()}, memory_wait=args.memory_wait)
    return worker, options

def _join_group(mode: str, checkpoint: CheckpointInfo) -> World:
    """``--distributed``: check mlx-lm can shard the family so, then join the group (it waits for every rank)."""
    from .distributed import DistributedError, join
    from .distributed.load import check_shardable
    from .models.loader import CheckpointError

    try:
        check_shardable(checkpoint, mode)
        world = join(mode)
    except (CheckpointError, DistributedError) as exc:
        raise UsageError(str(exc)) from exc
    logger.info("rank %d of %d (%s backend), %s parallel%s", world.rank, world.size, world.backend, mode,
                ": serving HTTP" if world.leader else ": following rank 0")
    return world
