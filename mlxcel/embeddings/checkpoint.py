"""An embedding checkpoint, inspected before anything loads (JSON and safetensors headers; no MLX)."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..models.loader import CheckpointError, check_safetensors
from .layout import EmbeddingLayout, LayoutError, read_layout

INSTALL = "pip install 'mlxcel[embeddings]'"


@dataclass(frozen=True)
class EmbeddingModel:
    """An embedding checkpoint: what serving it needs to know."""

    path: Path
    name: str
    model_type: str
    weight_bytes: int
    layout: EmbeddingLayout
    config: dict[str, Any] = field(compare=False, repr=False)


def inspect_embedding(directory: Path) -> EmbeddingModel:
    """Check *directory* is an embedding checkpoint mlxcel can serve; :class:`CheckpointError` saying why not
    (its files, its sentence-transformers layout, or mlx-embeddings missing or not knowing its architecture)."""
    config_path = directory / "config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{config_path} cannot be read as JSON: {exc}") from exc
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str) or not model_type:
        raise CheckpointError(f"{config_path} names no model_type")
    try:
        layout = read_layout(directory, config)
    except LayoutError as exc:
        raise CheckpointError(str(exc)) from exc
    weights = sorted(directory.glob("model*.safetensors"))
    if not weights:
        raise CheckpointError(f"{directory} has no model*.safetensors weights")
    for file in weights:
        check_safetensors(file)
    if not (directory / "tokenizer.json").is_file() and not (directory / "vocab.txt").is_file():
        raise CheckpointError(f"{directory} has no tokenizer (tokenizer.json or vocab.txt)")
    _check_runnable(directory.name, model_type)
    return EmbeddingModel(path=directory, name=directory.name, model_type=model_type,
                          weight_bytes=sum(file.stat().st_size for file in weights), layout=layout, config=config)


def _check_runnable(name: str, model_type: str) -> None:
    """mlx-embeddings is installed and has a model file for *model_type*: looked up on disk, not imported (its
    import pulls mlx-vlm and mlx, which belong on the model's thread)."""
    spec = importlib.util.find_spec("mlx_embeddings")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(f"{name} is an embedding model; serving it needs mlx-embeddings: {INSTALL}")
    module = model_type.replace("-", "_")
    models = [Path(root) / "models" for root in spec.submodule_search_locations]
    if not any((m / f"{module}.py").is_file() or (m / module / "__init__.py").is_file() for m in models):
        raise CheckpointError(f"{name}: model_type {model_type!r} is not one mlx-embeddings can run")
