"""Tiny Qwen 3.5 checkpoints for the tests and benchmarks, in the Hugging Face layout (needs the dev extra).

A target with mlx-lm's own classes (random weights, fixed seed; :func:`mlxcel.testing.checkpoints.build_checkpoint`
builds one from :data:`CONFIG`), written with the names and layouts Hugging Face stores (:func:`to_hf`), and
a target with an in-checkpoint MTP head of chosen quality (:func:`build_mtp_checkpoint`). The server
never imports this module.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlxcel.testing.base import SIZES, write_tokenizer

CONFIG: dict[str, Any] = {
    "model_type": "qwen3_5",
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "tie_word_embeddings": False,
    "text_config": {
        **SIZES,
        "model_type": "qwen3_5_text",
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "rope_parameters": {"type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0]},
    },
}

#: The layer shapes of Qwen3.5-0.8B's text model (its config.json): 8 query heads of 256 over 2 KV heads, a
#: full-attention layer in four, gated-delta mixers of 16 key and 16 value heads of 128. A benchmark pairing
#: built with them has a released model's per-layer costs (its vocabulary stays the tiny tokenizer's).
QWEN35_08B_LAYERS: dict[str, Any] = {
    "hidden_size": 1024, "intermediate_size": 3584, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 256, "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 16,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "rope_parameters": {"type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10]},
}


def to_hf(weights: dict[str, Any]) -> dict[str, Any]:
    """Undo mlx-lm's qwen3_5 sanitize: HF names, conv1d as (C, 1, K), zero-centred norms."""
    import mlx.core as mx

    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        hf = name.replace("language_model.model.", "model.language_model.").replace(
            "language_model.lm_head", "lm_head")
        if "conv1d.weight" in name:
            value = value.moveaxis(2, 1)
        elif value.ndim == 1 and name.endswith((".input_layernorm.weight", ".post_attention_layernorm.weight",
                                                "model.norm.weight", ".q_norm.weight", ".k_norm.weight")):
            value = value - 1.0
        out[hf] = value
    return out


def fuse_experts(weights: dict[str, Any]) -> dict[str, Any]:
    """mlx-lm's switch MLP back to Hugging Face's fused experts (what qwen3_5_moe's sanitize undoes)."""
    import mlx.core as mx

    out = dict(weights)
    for name in [n for n in weights if n.endswith(".switch_mlp.gate_proj.weight")]:
        prefix = name[:-len(".switch_mlp.gate_proj.weight")]
        gate, up = out.pop(name), out.pop(f"{prefix}.switch_mlp.up_proj.weight")
        out[f"{prefix}.experts.gate_up_proj"] = mx.concatenate([gate, up], axis=-2)
        out[f"{prefix}.experts.down_proj"] = out.pop(f"{prefix}.switch_mlp.down_proj.weight")
    return out


def build_mtp_checkpoint(directory: Path, *, drafter: str = "random", layers: int = 4, hidden: int = 64,
                         context_scale: float = 1.0, raw: bool = True, seed: int = 0, moe: bool = False,
                         positions: int = 4096, head_dim: int | None = None, released: bool = False) -> Path:
    """A tiny Qwen 3.5 target with an in-checkpoint ``mtp.*`` head.

    *drafter* ``random``: a random head, whose drafts the target rarely accepts.
    ``aligned``: the head predicts what the target will say. The target's
    sublayer outputs are scaled by *context_scale*; at 0 the next token is a
    fixed function f of the current one, and the aligned head, which reads
    only the embedding of the token it is given and applies the same LM head,
    predicts f of it: the token after next, always. Small non-zero scales give
    a target that mostly, not always, agrees with it.

    *raw*: the Hugging Face layout (zero-centred norms, conv1d as (C, 1, K));
    otherwise the layout mlx-lm's converter writes. *positions*: its context window. *head_dim*: its full
    attention's (16 by default; a quantized KV cache needs a multiple of 64). *released*: every layer shaped as
    :data:`QWEN35_08B_LAYERS` (*hidden* must then be its 1024).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    from mlxcel.families.qwen3_5.mtp import Qwen35MTP, text_args

    directory.mkdir(parents=True, exist_ok=True)
    config = json.loads(json.dumps(CONFIG))
    text = config["text_config"]
    text.update(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=2 * hidden,
                num_attention_heads=max(1, hidden // 16), num_key_value_heads=max(1, hidden // 32),
                max_position_embeddings=positions)
    if head_dim is not None:
        text["head_dim"] = head_dim
    if released:
        if hidden != QWEN35_08B_LAYERS["hidden_size"]:
            raise ValueError(f"Qwen3.5-0.8B's layers are {QWEN35_08B_LAYERS['hidden_size']} wide, not {hidden}")
        text.update(QWEN35_08B_LAYERS)
    config["mtp_num_hidden_layers"] = 1
    if moe:  # Qwen 3.6: every MLP (the head's included) a mixture of experts with a shared expert
        config["model_type"], text["model_type"] = "qwen3_5_moe", "qwen3_5_moe_text"
        config["architectures"] = ["Qwen3_5MoeForConditionalGeneration"]
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden,
                    shared_expert_intermediate_size=hidden, norm_topk_prob=True, decoder_sparse_step=1)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(directory, model_max_length=positions)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    head = Qwen35MTP(text_args(config), num_layers=1)
    outputs = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
    leaves: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    target = {name: (v * 2.0 if v.ndim > 1 else v) for name, v in leaves}
    target = {name: (v * context_scale if name.endswith(outputs) else v) for name, v in target.items()}
    head_leaves: list[tuple[str, Any]] = tree_flatten(head.parameters())  # type: ignore[assignment]
    mtp = {name: (v * 2.0 if v.ndim > 1 else v) for name, v in head_leaves}
    if drafter == "aligned":
        eye = mx.eye(hidden)
        mtp["fc.weight"] = mx.concatenate([eye, mx.zeros((hidden, hidden))], axis=1)
        mtp = {name: (mx.zeros_like(v) if name.endswith(outputs) else v) for name, v in mtp.items()}
    if raw:
        target = fuse_experts(to_hf(target))
        mtp = fuse_experts({name: (v - 1.0 if v.ndim == 1 and "norm" in name else v) for name, v in mtp.items()})
    weights = {**target, **{f"mtp.{name}": v for name, v in mtp.items()}}
    mx.eval(weights)
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "pt"})
    return directory
