"""Tiny checkpoints of mlx-lm's own families in the real Hugging Face layout, built by the tests themselves.

No model hub is reachable, so each family gets a few-layer model with random
weights (fixed seed) and the shared tokenizer (:mod:`.base`). The files
are what a user's download would hold: ``config.json``, ``model.safetensors``
(tensor names and layouts as Hugging Face stores them), ``tokenizer.json``,
``tokenizer_config.json`` with a ChatML chat template.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlxcel.families.qwen3_5 import tiny as qwen3_5
from mlxcel.testing.base import CHATML, SIZES, VOCAB_SIZE, write_tokenizer

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {**SIZES, "model_type": "llama", "architectures": ["LlamaForCausalLM"]},
    "qwen3": {**SIZES, "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]},
    qwen3_5.CONFIG["model_type"]: qwen3_5.CONFIG,  # a family of its own: mlxcel/families/qwen3_5/tiny.py
}
FAMILIES = tuple(CONFIGS)

_TO_HF: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {qwen3_5.CONFIG["model_type"]: qwen3_5.to_hf}


def build_checkpoint(directory: Path, family: str, seed: int = 0, scale: float = 1.0,
                     chat_template: str = CHATML, markers: tuple[str, ...] = (), **overrides: Any) -> Path:
    """Write a tiny *family* checkpoint into *directory* (created) and return it.

    *scale* multiplies the random weights: larger values give peakier output
    distributions, so greedy decoding has no near-ties. *markers*: tokens of the
    vocabulary mlx-lm reads a model's formats from (``<think>``, ...), within its
    size. *overrides*: config values on top of the family's (a bigger model for a benchmark).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    directory.mkdir(parents=True, exist_ok=True)
    config = {**CONFIGS[family], **overrides}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    from mlxcel.models.loader import context_length

    write_tokenizer(directory, chat_template, added=markers, vocab_size=VOCAB_SIZE - len(markers),
                    model_max_length=context_length(config))
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    weights = {name: (v * scale if v.ndim > 1 else v) for name, v in weights.items()}
    weights = _TO_HF.get(family, lambda w: w)(weights)
    mx.eval(weights)
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "pt"})
    return directory


def write_weight_index(directory: Path) -> Path:
    """Add ``model.safetensors.index.json`` (every tensor -> its file), as a sharded Hugging Face checkpoint has.

    mlx-lm's pipeline loading reads it to pick each rank's files.
    """
    import mlx.core as mx

    weight_map = {name: file.name for file in sorted(directory.glob("model*.safetensors"))
                  for name in mx.load(str(file))}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    return directory
