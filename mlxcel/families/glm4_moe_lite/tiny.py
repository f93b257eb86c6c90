"""A tiny raw GLM-4.7-Flash (``glm4_moe_lite``) checkpoint, in the layout of ``zai-org/GLM-4.7-Flash``.

The target is transformers' own ``Glm4MoeLiteForCausalLM`` (random weights,
fixed seed) saved by ``save_pretrained``; its DeepSeek-V3 next-token layer sits
where the real repository keeps it, at ``model.layers.{num_hidden_layers}.*``
in the raw names (``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj``, one MLA
+ MoE decoder block with per-expert tensors and a full ``kv_b_proj``,
``shared_head.norm``, ``shared_head.head``). The decoder block's tensors are
those transformers writes for one more decoder layer; the rest is written by
hand. The weights are sharded with a ``model.safetensors.index.json``, the
next-token layer spanning two shards and one shard holding none of it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from mlxcel.testing.base import write_tokenizer

TEXT: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
    "routed_scaling_factor": 1.8, "kv_lora_rank": 32, "q_lora_rank": 24, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16, "v_head_dim": 16, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
    "initializer_range": 0.25, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}
#: What the real config.json also says, in the names mlx-lm reads.
EXTRA = {"rope_theta": 10000.0, "first_k_dense_replace": 1, "num_nextn_predict_layers": 1, "topk_method": "noaux_tc"}
#: Sublayer outputs: scaled by ``context_scale`` in the target, zero in an aligned next-token layer.
OUTPUTS = ("o_proj.weight", "down_proj.weight")


def build_glm_checkpoint(directory: Path, *, drafter: str = "random", context_scale: float = 1.0,
                         seed: int = 0, text: dict[str, Any] | None = None, nextn: bool = True) -> Path:
    """Write the checkpoint into *directory* and return it.

    *drafter* ``random``: a random next-token layer. ``aligned``: one that
    predicts what the target will say when *context_scale* is small (then the
    target's next token is nearly a function of the current one, and the layer
    applies the target's embedding, final norm and head to its token alone).
    *nextn* False: the layer left out, as community conversions do.
    """
    import torch
    from safetensors.numpy import save_file
    from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

    text = {**TEXT, **(text or {})}
    layers = int(text["num_hidden_layers"])
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    # One decoder layer more than the target has: its tensors become the next-token layer's block.
    model = Glm4MoeLiteForCausalLM(Glm4MoeLiteConfig(**{**text, "num_hidden_layers": layers + 1}))
    model.save_pretrained(str(directory / "_full"))
    from safetensors.numpy import load_file

    full = load_file(str(directory / "_full" / "model.safetensors"))
    for file in (directory / "_full").iterdir():
        file.unlink()
    (directory / "_full").rmdir()
    rng = np.random.default_rng(seed)
    prefix = f"model.layers.{layers}."
    target = {k: v for k, v in full.items() if not k.startswith(prefix)}
    block = {k[len(prefix):]: v for k, v in full.items() if k.startswith(prefix)}
    for name in [n for n in target if n.endswith("e_score_correction_bias")] + ["mlp.gate.e_score_correction_bias"]:
        bank = target if name in target else block  # selection-only bias: make it matter
        bank[name] = rng.normal(scale=0.5, size=bank[name].shape).astype(np.float32)
    target = {k: (v * context_scale if k.endswith(OUTPUTS) else v) for k, v in target.items()}
    hidden, vocab = int(text["hidden_size"]), int(text["vocab_size"])
    if drafter == "aligned":
        block = {k: (np.zeros_like(v) if k.endswith(OUTPUTS) else v) for k, v in block.items()}
        own = {"embed_tokens.weight": target["model.embed_tokens.weight"],
               "enorm.weight": np.ones(hidden, np.float32), "hnorm.weight": np.ones(hidden, np.float32),
               "eh_proj.weight": np.concatenate([np.eye(hidden), np.zeros((hidden, hidden))], 1).astype(np.float32),
               "shared_head.norm.weight": target["model.norm.weight"],
               "shared_head.head.weight": target["lm_head.weight"]}
    else:
        def normal(*shape: int, scale: float = 0.25) -> np.ndarray:
            return rng.normal(scale=scale, size=shape).astype(np.float32)

        own = {"embed_tokens.weight": normal(vocab, hidden, scale=1.0),
               "enorm.weight": 1 + normal(hidden, scale=0.1),
               "hnorm.weight": 1 + normal(hidden, scale=0.1), "eh_proj.weight": normal(hidden, 2 * hidden, scale=0.15),
               "shared_head.norm.weight": 1 + normal(hidden, scale=0.1),
               "shared_head.head.weight": normal(vocab, hidden)}
    weights = {**target, **({f"{prefix}{k}": v for k, v in {**block, **own}.items()} if nextn else {})}
    _write_shards(directory, {k: np.ascontiguousarray(v) for k, v in weights.items()}, prefix, save_file)
    config = {**json.loads(model.config.to_json_string()), **EXTRA, "num_hidden_layers": layers,
              "architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite", "dtype": "float32"}
    config.pop("mlp_layer_types", None)  # derived from num_hidden_layers (the saved list has one too many)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_tokenizer(directory)
    return directory


def _write_shards(directory: Path, weights: dict[str, np.ndarray], nextn_prefix: str, save: Any) -> None:
    """Three shards: the target's first half; its second half with part of the next-token layer; the rest."""
    names = sorted(weights)
    target = [n for n in names if not n.startswith(nextn_prefix)]
    nextn = [n for n in names if n.startswith(nextn_prefix)]
    half, split = len(target) // 2, len(nextn) // 3
    shards = [target[:half], target[half:] + nextn[:split], nextn[split:]]
    shards = [s for s in shards if s]
    weight_map = {}
    for number, shard in enumerate(shards, 1):
        file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save({n: weights[n] for n in shard}, str(directory / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in shard})
    total = sum(v.nbytes for v in weights.values())
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
