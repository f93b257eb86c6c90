"""Loading this rank's shard with mlx-lm's own sharded loading."""

from __future__ import annotations

import logging
import time
from typing import Any

from ..models.loader import CheckpointError, CheckpointInfo, declared_tokenizer
from .world import World

logger = logging.getLogger(__name__)


def check_shardable(checkpoint: CheckpointInfo, mode: str) -> None:
    """Whether mlx-lm can shard *checkpoint*'s family in *mode*, checked before anything is loaded.

    mlx-lm's rules: tensor parallelism needs the family's ``Model.shard``; a
    pipeline needs its inner model to be a ``PipelineMixin``, and mlx-lm's
    pipeline loading reads ``model.safetensors.index.json`` to pick each rank's files.

    Raises:
        CheckpointError: one line saying what is missing.
    """
    from mlx_lm.models.pipeline import PipelineMixin

    from ..models.loader import mlx_lm_module

    module = mlx_lm_module(checkpoint.model_type)
    if module is None:
        raise CheckpointError(f"--distributed needs a family mlx-lm implements; {checkpoint.model_type} is not one")
    if mode == "tensor" and not hasattr(getattr(module, "Model", None), "shard"):
        raise CheckpointError(f"mlx-lm has no tensor parallelism for {checkpoint.model_type} "
                              "(its Model has no shard()); try --distributed pipeline")
    if mode == "pipeline":
        if not any(isinstance(c, type) and issubclass(c, PipelineMixin) and c is not PipelineMixin
                   for c in vars(module).values()):
            raise CheckpointError(f"mlx-lm cannot pipeline {checkpoint.model_type} (no PipelineMixin model); "
                                  "try --distributed tensor")
        if not (checkpoint.path / "model.safetensors.index.json").is_file():
            raise CheckpointError(f"{checkpoint.path} has no model.safetensors.index.json, which mlx-lm's "
                                  "pipeline loading reads to choose each rank's weight files")


def load_shard(checkpoint: CheckpointInfo, world: World) -> tuple[Any, Any]:
    """(model, tokenizer): this rank's part of *checkpoint*, by ``mlx_lm.utils.sharded_load``.

    Pipeline: this rank's run of layers (rank 0 the last ones, which end in the
    logits); tensor: a slice of every layer. Every rank keeps the embeddings,
    the final norm and the head. Collective: every rank calls it at the same
    time, and it returns when all of them have loaded.

    Raises:
        CheckpointError: mlx-lm cannot shard this family that way, or cannot load it.
    """
    from mlx_lm.utils import sharded_load

    started = time.perf_counter()
    groups = {"pipeline_group" if world.mode == "pipeline" else "tensor_group": world.group}
    try:
        model, tokenizer = sharded_load(str(checkpoint.path), **groups)
    except Exception as exc:  # mlx-lm raises ValueError for a family without that sharding, ...
        raise CheckpointError(f"cannot load {checkpoint.path} sharded ({world.mode}): {exc}") from exc
    model.eval()
    logger.info("rank %d/%d: loaded its %s shard of %s in %.1fs", world.rank, world.size, world.mode,
                checkpoint.name, time.perf_counter() - started)
    return model, declared_tokenizer(checkpoint.path, tokenizer)


def load_leader(checkpoint: CheckpointInfo, world: World) -> tuple[Any, Any]:
    """Rank 0's shard, wrapped in a :class:`~mlxcel.distributed.mirror.Leader`, and the tokenizer."""
    from .mirror import Leader

    model, tokenizer = load_shard(checkpoint, world)
    return Leader(model, world.group), tokenizer
