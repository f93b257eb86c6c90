"""GLM-4.7-Flash's DeepSeek-V3-style next-token layer (``glm4_moe_lite_mtp``).

The raw checkpoint keeps it at ``model.layers.{num_hidden_layers}.*``, which
mlx-lm's and transformers' loaders drop; ``mlxcel split-mtp``
(:mod:`.glm4_moe_lite_split`) writes it out as a standalone directory, which
is what this module loads. Nothing is borrowed from the target: the layer has
its own embedding, its own final norm and its own (untied) head, and a KV
cache of its own. One step predicts the token after next::

    x = eh_proj([enorm(embed(token)) ; hnorm(hidden)])
    x = block(x)                       # one MLA + MoE decoder layer
    logits = lm_head(shared_head_norm(x))

where ``hidden`` is the target's final (normed) hidden state at the position
before ``token``; chained drafts feed the block output ``x`` back as the next
``hidden``. The block is mlx-lm's own ``Glm4MoeLiteDecoderLayer`` (absorbed
MLA, sigmoid routing with a selection-only correction bias, routed scaling,
shared expert), so the split layout is the one mlx-lm's ``glm4_moe_lite``
sanitize produces: ``kv_b_proj`` decomposed into ``embed_q`` / ``unembed_out``,
experts stacked for its switch MLP.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models.glm4_moe_lite import Glm4MoeLiteDecoderLayer, ModelArgs

from ...models.drafters.own_cache import OwnCacheBatch, OwnCacheSequence

STANDALONE_TYPE = "glm4_moe_lite_mtp"
SOURCE_TYPE = "glm4_moe_lite"


class _Body(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        hidden = args.hidden_size
        self.embed_tokens = nn.Embedding(args.vocab_size, hidden)
        self.enorm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        self.hnorm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        # The index past the target's layers: a MoE layer wherever the target's later layers are.
        self.mtp_block = Glm4MoeLiteDecoderLayer(args, layer_idx=args.num_hidden_layers)
        self.shared_head_norm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)


class Glm4MoeLiteMTP(nn.Module):
    """The next-token layer, named as the standalone directory stores it."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.model = _Body(args)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: list[Any]) -> mx.array:
        body = self.model
        x = body.eh_proj(mx.concatenate([body.enorm(embeddings), body.hnorm(hidden)], axis=-1))
        mask = create_attention_mask(x, cache[0], return_array=True)
        out: mx.array = body.mtp_block(x, mask, cache[0])
        return out

    def remember(self, embeddings: mx.array, hidden: mx.array, cache: list[Any]) -> list[mx.array]:
        """Write these positions into *cache* as :meth:`__call__` would, without their outputs (a drafter
        catching up reads its last position's alone): the layer's compressed keys and rotary keys are its
        input's projections, the bytes :meth:`__call__` writes; its attention and mixture of experts over
        these positions are skipped. The arrays to evaluate."""
        body = self.model
        x = body.eh_proj(mx.concatenate([body.enorm(embeddings), body.hnorm(hidden)], axis=-1))
        attention = body.mtp_block.self_attn
        batch, length, _ = x.shape
        compressed, rotary = mx.split(attention.kv_a_proj_with_mqa(body.mtp_block.input_layernorm(x)),
                                      [attention.kv_lora_rank], axis=-1)
        rotary = attention.rope(rotary.reshape(batch, length, 1, attention.qk_rope_head_dim).transpose(0, 2, 1, 3),
                                cache[0].offset)
        latent, rotary = cache[0].update_and_fetch(mx.expand_dims(attention.kv_a_layernorm(compressed), axis=1),
                                                   rotary)
        return [latent, rotary]

    def logits(self, x: mx.array) -> mx.array:
        out: mx.array = self.lm_head(self.model.shared_head_norm(x))
        return out

    def make_cache(self) -> list[Any]:
        return [KVCache()]


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = config.get("text_config", config)
    return nested


def text_args(config: dict[str, Any]) -> ModelArgs:
    return ModelArgs.from_dict(text_config(config))


def quantizable(name: str, shape: tuple[int, ...], group_size: int) -> bool:
    """Whether the split quantizes this tensor: every matrix weight whose rows divide into groups,
    except the router's (its scores pick the experts; upstream keeps it exact too)."""
    return (name.endswith(".weight") and len(shape) >= 2 and shape[-1] % group_size == 0
            and not name.endswith("mlp.gate.weight"))


def _quantize_like_the_split(head: Glm4MoeLiteMTP, quantization: dict[str, Any] | None) -> None:
    if not quantization:
        return
    group, bits = int(quantization["group_size"]), int(quantization["bits"])
    nn.quantize(head, group_size=group, bits=bits,
                class_predicate=lambda path, m: hasattr(m, "to_quantized")
                and quantizable(f"{path}.weight", tuple(m.weight.shape), group))


def _new_head(config: dict[str, Any]) -> Glm4MoeLiteMTP:
    args = text_args(config)
    if args.num_attention_heads <= 0 or args.kv_lora_rank <= 0 or args.hidden_size <= 0:
        raise ValueError("num_attention_heads, kv_lora_rank and hidden_size must be positive")
    head = Glm4MoeLiteMTP(args)
    _quantize_like_the_split(head, config.get("quantization"))
    return head


def inventory(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor (name -> shape) a standalone directory of *config* must hold."""
    from mlx.utils import tree_flatten

    leaves: list[tuple[str, mx.array]] = tree_flatten(_new_head(config).parameters())  # type: ignore[assignment]
    return {name: tuple(value.shape) for name, value in leaves}


def standalone_config(source: dict[str, Any], block_size: int, quantization: dict[str, Any] | None) -> dict[str, Any]:
    """The directory's ``config.json``: the source's text config (its quantization dropped), the K to run."""
    text = {k: v for k, v in text_config(source).items() if k not in ("quantization", "quantization_config")}
    config: dict[str, Any] = {"model_type": STANDALONE_TYPE, "block_size": block_size, "tie_word_embeddings": False,
                              "text_config": {**text, "model_type": SOURCE_TYPE}}
    if quantization:
        config["quantization"] = config["quantization_config"] = {**quantization, "mode": "affine"}
    return config


def default_block_size(source: dict[str, Any]) -> int:
    """One verified position per next-token layer, plus the bonus token (2 on GLM-4.7-Flash)."""
    return max(2, int(text_config(source).get("num_nextn_predict_layers") or 1) + 1)


def load(directory: Path) -> Glm4MoeLiteMTP:
    """The layer from a standalone directory (strict: every tensor, nothing else). Worker thread only."""
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    head = _new_head(config)
    weights: dict[str, mx.array] = {}
    for file in sorted(directory.glob("*.safetensors")):
        weights.update(mx.load(str(file)))  # type: ignore[arg-type]
    head.load_weights(list(weights.items()), strict=True)
    return head


class Glm4MoeLiteDrafter:
    """The :class:`~mlxcel.models.speculative.DraftHead` of a GLM-4.7-Flash target: the layer with
    its own embedding and head (it reads only the target's hidden states)."""

    def __init__(self, head: Glm4MoeLiteMTP) -> None:
        self.head = head
        self.embed = head.model.embed_tokens
        self.lm_head = head.logits

    def new_sequence(self, cache: list[Any]) -> OwnCacheSequence:
        del cache  # the layer keeps a cache of its own
        return OwnCacheSequence(self)

    def new_batch(self) -> OwnCacheBatch:
        """The rows of a continuous batch drafting together: the layer's caches merged as the batch's are."""
        return OwnCacheBatch(self)
