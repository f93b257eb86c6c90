"""What makes a checkpoint an embedding model, read from sentence-transformers' files (no MLX).

An embedding checkpoint in the sentence-transformers layout says how its token states become one vector:
``modules.json`` lists the pipeline (the encoder, a ``Pooling`` module, perhaps ``Normalize``),
``1_Pooling/config.json`` (or wherever ``modules.json`` puts it) names the pooling mode, and
``sentence_bert_config.json`` the longest input. Encoder checkpoints (BERT, XLM-R, ModernBERT) and decoder
ones (Qwen3-Embedding: last-token pooling) share it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_MODULES = "sentence_transformers.models."
_POOLING_FLAGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
                  "pooling_mode_max_tokens": "max", "pooling_mode_lasttoken": "lasttoken",
                  "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
                  "pooling_mode_weightedmean_tokens": "weightedmean"}
#: Padded tokens one forward holds (rows x their longest); a longer input runs alone.
BATCH_TOKENS = 4096
#: The longest input mlxcel embeds whatever the checkpoint allows (OpenAI's own bound is 8,191).
MAX_INPUT_TOKENS = 8192
#: The pooling modes mlxcel computes (sentence-transformers' others are refused by name).
POOLING_MODES = ("mean", "cls", "max", "lasttoken")


class LayoutError(Exception):
    """An embedding checkpoint whose sentence-transformers files cannot be served; the message says which and why."""


@dataclass(frozen=True)
class EmbeddingLayout:
    """How one embedding checkpoint turns tokens into a vector."""

    pooling: str
    """One of :data:`POOLING_MODES`."""
    normalize: bool
    """Whether the vector is scaled to unit length (a ``Normalize`` module)."""
    dimensions: int
    """The vector's length."""
    max_tokens: int
    """The longest input, in tokens (``max_seq_length``, else the model's positions)."""
    truncatable: tuple[int, ...] | None
    """The shorter lengths a request's ``dimensions`` may ask for: () any, None none (not a Matryoshka model)."""


def is_embedding_checkpoint(directory: Path) -> bool:
    """Whether *directory* holds sentence-transformers' ``modules.json`` naming a ``Pooling`` module."""
    try:
        modules = json.loads((directory / "modules.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(modules, list) and any(isinstance(m, dict) and m.get("type") == _MODULES + "Pooling"
                                             for m in modules)


def read_layout(directory: Path, config: dict[str, Any]) -> EmbeddingLayout:
    """The layout of the embedding checkpoint *directory*, whose ``config.json`` is *config*; :class:`LayoutError`
    for a pipeline mlxcel cannot reproduce exactly (a ``Dense`` projection, several pooling modes at once)."""
    modules = _json(directory / "modules.json")
    if not isinstance(modules, list):
        raise LayoutError(f"{directory / 'modules.json'} is not a list of modules")
    pooling_dir: Path | None = None
    normalize = False
    for module in modules:
        kind = str(module.get("type", "")) if isinstance(module, dict) else ""
        name = kind.removeprefix(_MODULES)
        if name == "Pooling":
            pooling_dir = directory / str(module.get("path", "1_Pooling"))
        elif name == "Normalize":
            normalize = True
        elif name != "Transformer":
            raise LayoutError(f"{directory.name}: the sentence-transformers module {kind or module!r} is not "
                              "supported (mlxcel serves Transformer, Pooling and Normalize)")
    if pooling_dir is None:
        raise LayoutError(f"{directory / 'modules.json'} names no Pooling module")
    pooling = _json(pooling_dir / "config.json")
    if not isinstance(pooling, dict):
        raise LayoutError(f"{pooling_dir / 'config.json'} is not a JSON object")
    mode = _pooling_mode(pooling, pooling_dir)
    hidden = config.get("hidden_size")
    dimensions = pooling.get("word_embedding_dimension", pooling.get("embedding_dimension", hidden))
    if not isinstance(dimensions, int) or dimensions < 1 or dimensions != hidden:
        raise LayoutError(f"{pooling_dir / 'config.json'}: the embedding dimension {dimensions!r} is not the "
                          f"model's hidden size {hidden!r}")
    return EmbeddingLayout(pooling=mode, normalize=normalize, dimensions=dimensions,
                           max_tokens=_max_tokens(directory, config), truncatable=_truncatable(config, dimensions))


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise LayoutError(f"{path} is missing") from exc
    except (OSError, ValueError) as exc:
        raise LayoutError(f"{path} cannot be read as JSON: {exc}") from exc


def _pooling_mode(pooling: dict[str, Any], where: Path) -> str:
    named = pooling.get("pooling_mode")  # newer sentence-transformers write the mode by name
    modes = [named] if isinstance(named, str) else [mode for flag, mode in _POOLING_FLAGS.items() if pooling.get(flag)]
    if len(modes) != 1:
        raise LayoutError(f"{where / 'config.json'}: expected one pooling mode, found {modes or 'none'}")
    mode = {"mean_tokens": "mean", "cls_token": "cls", "max_tokens": "max"}.get(modes[0], modes[0])
    if mode not in POOLING_MODES:
        raise LayoutError(f"{where / 'config.json'}: pooling mode {mode!r} is not supported "
                          f"(supported: {', '.join(POOLING_MODES)})")
    return mode


def _max_tokens(directory: Path, config: dict[str, Any]) -> int:
    """sentence-transformers' ``max_seq_length`` (it truncates there), else the model's own bound."""
    positions = config.get("max_position_embeddings")
    if config.get("model_type") in ("xlm-roberta", "roberta") and isinstance(positions, int):
        positions -= int(config.get("pad_token_id", 1)) + 1  # positions start after the padding index
    try:
        declared = json.loads((directory / "sentence_bert_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        declared = {}
    chosen = declared.get("max_seq_length") if isinstance(declared, dict) else None
    bounds = [v for v in (chosen, positions) if isinstance(v, int) and v > 0]
    return min([*bounds, MAX_INPUT_TOKENS]) if bounds else 512


def embedding_working_bytes(config: dict[str, Any], max_tokens: int) -> int:
    """A bound on the memory of the largest forward: float32 activations of ``T`` tokens (the residual stream
    and its projections, the MLP's two widest), and attention scores, rows x heads x length^2, which a batch of
    at most ``T`` padded tokens keeps under heads x ``T`` x length; ``T`` is :data:`BATCH_TOKENS`, or one
    input of *max_tokens* when that is longer."""
    hidden = int(config.get("hidden_size", 0) or 0)
    wide = int(config.get("intermediate_size", 4 * hidden) or 4 * hidden)
    heads = int(config.get("num_attention_heads", 1) or 1)
    tokens = max(BATCH_TOKENS, max_tokens)
    return 4 * tokens * (4 * hidden + 2 * wide) + 4 * heads * tokens * max_tokens


def _truncatable(config: dict[str, Any], dimensions: int) -> tuple[int, ...] | None:
    """A Matryoshka model says so in its config as vLLM reads it: ``matryoshka_dimensions`` (those lengths) or
    ``is_matryoshka`` (any length)."""
    listed = config.get("matryoshka_dimensions")
    if isinstance(listed, list) and all(isinstance(d, int) and 0 < d <= dimensions for d in listed):
        return tuple(sorted(listed))
    return () if config.get("is_matryoshka") is True else None
