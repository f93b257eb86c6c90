"""Turning the ``mlxcel serve`` options (:mod:`mlxcel.serve_args`) into a :class:`~mlxcel.serve.ServeConfig`.

Everything that can be wrong with the settings is found here, before the port
is bound: a bad environment value, a missing or broken model directory, an
unreadable key file. Each is one line and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import DEFAULT_DRAFT_BLOCK_SIZE, ConfigError, EnvConfig, load_env, parse_draft_block_size
from .embeddings.layout import is_embedding_checkpoint
from .families.qwen3_5 import BUNDLED_MODEL
from .fleet import MODEL_OPTIONS, CatalogError
from .serve_args import default_prompt_cache_bytes, default_prompt_cache_disk_bytes
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
    if args.model is not None and is_embedding_checkpoint(args.model):  # served as a fleet of one
        return _fleet_config(args, env, blas, keys, chosen_block_size, embedding=True)
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
    if args.allow_private_image_urls and not args.allow_image_urls:
        raise UsageError("--allow-private-image-urls widens --allow-image-urls: give both")
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
        from .fleet.residency import size
        from .fleet.slot import model_charge

        need = model_charge(checkpoint, worker)
        if need > args.memory_budget:
            raise UsageError(f"{checkpoint.name} needs {size(need)} (weights, drafter, prefix cache bound), more "
                             f"than --memory-budget {size(args.memory_budget)}")
    connections = connection_limits(args)
    return ServeConfig(checkpoint=checkpoint, worker=worker, options=options, host=args.host, port=args.port,
                       budget=args.memory_budget,
                       max_queue_depth=args.max_queue_depth, blas=blas, connections=connections,
                       access_log=args.access_log)


def _fleet_config(args: argparse.Namespace, env: EnvConfig, blas: str, keys: tuple[str, ...],
                  chosen_block_size: int | None, embedding: bool = False) -> FleetConfig:
    """``--model-dir`` / ``--models`` (or *embedding*: ``--model`` is an embedding checkpoint): the catalog,
    checked now, and how each model is built when first asked for."""
    from .checkpoints import inspect_checkpoint
    from .embeddings.checkpoint import inspect_embedding
    from .fleet import Catalog, ModelEntry, catalog
    from .fleet.serve import FleetConfig
    from .fleet.slot import EmbeddingParts, ModelParts, Parts
    from .http.listener import connection_limits
    from .models.loader import CheckpointError, import_mlx_lm
    from .server import ServerOptions

    if args.distributed:
        raise UsageError("--distributed shards one model: it does not combine with --model-dir or --models"
                         if not embedding else f"{args.model} is an embedding model: --distributed shards "
                                               "generation models only")
    if args.served_model_name and not embedding:
        raise UsageError("--served-model-name names one model: with --models, give each model its names there")
    if (args.mtp or args.draft_model is not None) and (args.model is None or embedding):
        raise UsageError("--mtp and --draft-model apply to --model; with --models, say mtp or draft per model"
                         if not embedding else f"{args.model} is an embedding model: it has no MTP drafter")
    try:
        models = catalog(args.model, args.model_dir, args.models) if not embedding else \
            Catalog([ModelEntry(args.model, names=tuple(args.served_model_name or ()))])
        if embedding:
            inspect_embedding(args.model)  # a lone model's problems stop the start, as a generation model's do
    except (CatalogError, CheckpointError) as exc:
        raise UsageError(str(exc)) from exc
    import_mlx_lm()
    available = tuple(models.ids())
    flagged = args.model.resolve() if args.model is not None else None

    def build(entry: ModelEntry) -> Parts:
        if is_embedding_checkpoint(entry.path):
            if entry.mtp or entry.draft is not None:
                raise CheckpointError(f"{entry.id} is an embedding model: it has no MTP drafter")
            model = inspect_embedding(entry.path)
            name, *aliases = dict.fromkeys([*entry.exact_names, model.name])
            return EmbeddingParts(model, ServerOptions(
                model_name=name, aliases=tuple(aliases), patterns=entry.patterns, available=available,
                model_path=entry.path, context_length=model.layout.max_tokens, api_keys=keys,
                max_body_bytes=args.max_body_bytes, props=args.props, slots=args.slots, metrics=args.metrics,
                extra_props={"blas": blas, "pid": os.getpid()}), env.policy)
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

    logger.info("%d model%s: %s", len(available), "s" if len(available) > 1 else "", ", ".join(available))
    return FleetConfig(catalog=models, build=build, policy=env.policy, api_keys=keys,
                       max_body_bytes=args.max_body_bytes, max_loaded=args.max_loaded, budget=_budget(args),
                       idle_unload=args.idle_unload, host=args.host, port=args.port, blas=blas,
                       connections=connection_limits(args), access_log=args.access_log, metrics=args.metrics)


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
    from .server.images import ImageLimits

    option = {**{key: getattr(args, key) for key in MODEL_OPTIONS}, **(overrides or {})}
    prompt = _image_prompt(checkpoint, sharding is not None)
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
                            measure_kv=budgeted, vision=prompt is not None)
    # The first served name is the model's; the others and the directory's name are accepted too.
    name, *aliases = dict.fromkeys([*names, checkpoint.name])
    options = ServerOptions(
        model_name=name, aliases=tuple(aliases), patterns=patterns, available=available,
        model_path=checkpoint.path, context_length=checkpoint.context_length,
        parallel=parallel, default_max_tokens=option["max_tokens"], api_keys=keys,
        max_body_bytes=args.max_body_bytes, props=args.props, slots=args.slots, metrics=args.metrics,
        extra_props={"blas": blas, "draft_block_size": block_size, "pid": os.getpid()}, memory_wait=args.memory_wait,
        image_limits=ImageLimits(args.max_images, args.max_image_bytes, args.max_image_pixels, args.allow_image_urls,
                                 args.allow_private_image_urls, args.image_fetch_timeout), image_prompt=prompt)
    return worker, options

def _image_prompt(checkpoint: CheckpointInfo, sharded: bool) -> Any:
    """A vision checkpoint's :class:`~mlxcel.models.images.ImagePrompt` when its vision half can be served: mlx-vlm
    and Pillow installed (the ``vision`` extra), one process; else None, said once: it serves its text half."""
    import importlib.util

    from .checkpoints import image_prompt

    prompt = image_prompt(checkpoint)
    if prompt is None:
        return None
    if sharded:
        logger.warning("%s is a vision model; sharded (--distributed), it serves text only", checkpoint.name)
        return None
    if importlib.util.find_spec("mlx_vlm") is None or importlib.util.find_spec("PIL") is None:
        logger.warning("%s is a vision model; it serves text only without mlx-vlm and Pillow: "
                       "pip install 'mlxcel[vision]'", checkpoint.name)
        return None
    logger.info("%s takes images", checkpoint.name)
    return prompt


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
