"""The worker's start: the model, its stream, the MTP set-up, and whether it batches. Worker thread only."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..hardware import HostInfo, detect_host
from ..models.families import BATCH_BROKEN
from ..models.loader import CheckpointInfo, load_checkpoint
from .batch import batchable
from .messages import WorkerSettings
from .speculation import Speculation

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Loaded:
    model: Any
    tokenizer: Any
    stream: Any
    """The MLX stream every call of the worker runs on."""
    eos_tokens: frozenset[int]
    vocab: int
    """The width of the model's logits."""
    embedding_rows: int
    """Token ids below this have an input embedding."""
    host: HostInfo
    speculation: Speculation | None
    batching: bool
    parallel: int
    """Sequences decoding at once: ``--parallel`` when batching, else 1."""


def load(settings: WorkerSettings, checkpoint: CheckpointInfo, check: Callable[[], None]) -> Loaded:
    """Load *checkpoint* and set up what serving it needs; *check* raises to abandon (a stop)."""
    import mlx.core as mx

    model, tokenizer = load_checkpoint(checkpoint, check=check)
    _warn_if_slow_here(model, checkpoint.name)
    host = detect_host()
    stream = mx.new_stream(mx.default_device())
    with mx.stream(stream):  # one token through the model: the width of its logits
        vocab = int(model(mx.array([[0]])).shape[-1])
    speculation = None
    if settings.drafter is not None and settings.batch:  # the legacy worker has no MTP path
        from .speculation import set_up

        speculation = set_up(settings.drafter, checkpoint, model, stream, host.label, settings.block_size, vocab,
                             settings.policy.allow_inexact, settings.draft_quantize, check=check)
    check()
    # Batching needs caches that merge, and a batch mlx-lm gets right; without it (or with
    # --no-batch) sequences decode solo, one at a time, first come first served.
    broken = BATCH_BROKEN.get(checkpoint.model_type)
    batching = settings.batch and settings.parallel > 1 and batchable(model) and not broken
    if settings.batch and not batching and settings.parallel > 1:
        logger.warning("%s: serving one sequence at a time (%s)", checkpoint.name,
                       broken or "its caches cannot be merged into a batch")
    return Loaded(model, tokenizer, stream, frozenset(tokenizer.eos_token_ids), vocab, _embedding_rows(model, vocab),
                  host, speculation, batching, settings.parallel if batching else 1)


def _embedding_rows(model: Any, vocab: int) -> int:
    """Rows of the model's token embedding (``embed_tokens``, or gpt2's ``wte``, ...), else the logits' width.

    The smallest such table that a token id indexes: an id past it is read as garbage, not refused, by MLX.
    """
    import mlx.nn as nn

    rows = [module.weight.shape[0] for name, module in model.named_modules()
            if isinstance(module, nn.Embedding | nn.QuantizedEmbedding)
            and name.rsplit(".", 1)[-1] in ("embed_tokens", "wte", "tok_embeddings", "word_embeddings", "embeddings",
                                           "embedding", "emb")]
    return min(rows, default=vocab)


def _warn_if_slow_here(model: Any, name: str) -> None:
    """Half-precision weights on the CPU backend serve correctly but slowly: say so, once, at start."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    if mx.default_device() != mx.cpu:
        return
    leaves: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    dtypes = {array.dtype for _, array in leaves if array.dtype in (mx.bfloat16, mx.float16)}
    if dtypes:
        logger.warning("%s has %s weights: on the CPU backend they compute correctly, but slower than float32 "
                       "(2-4x per matmul measured on x86); mlx-lm's convert --dtype float32 makes a faster copy",
                       name, "/".join(sorted(str(d).removeprefix("mlx.core.") for d in dtypes)))
