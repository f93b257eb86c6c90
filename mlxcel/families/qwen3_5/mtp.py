"""The Qwen 3.5 / 3.6 / 3.8 multi-token-prediction head (``qwen3_5_mtp``).

Stored in the target's own checkpoint as ``mtp.*`` tensors (mlx-lm's loader
drops them): ``fc``, ``pre_fc_norm_embedding``, ``pre_fc_norm_hidden``,
``layers.N`` (full-attention decoder layers of the target's own kind) and
``norm``. It shares the target's embedding and LM head, and keeps a KV cache
of its own. One step predicts the token after next::

    g = norm(layers(fc([norm_e(embed(token)) ; norm_h(hidden)])))
    logits = lm_head(g)

where ``hidden`` is the target's final (normed) hidden state at the position
before ``token``; chained drafts feed ``g`` back as the next ``hidden``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs

from ...models.drafters.own_cache import OwnCacheBatch, OwnCacheSequence

#: 1-D weights Hugging Face stores zero-centred (the model adds 1 at run time).
NORM_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
                 ".k_norm.weight", "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight", "norm.weight")


class Qwen35MTP(nn.Module):
    def __init__(self, args: TextModelArgs, num_layers: int) -> None:
        super().__init__()
        hidden = args.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        # A layer index that makes DecoderLayer a full-attention layer.
        full = args.full_attention_interval - 1
        self.layers = [DecoderLayer(args, layer_idx=full) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: list[Any]) -> mx.array:
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embeddings),
                                    self.pre_fc_norm_hidden(hidden)], axis=-1))
        mask = create_attention_mask(x, cache[0])
        for layer, layer_cache in zip(self.layers, cache, strict=True):
            x = layer(x, mask, layer_cache)
        out: mx.array = self.norm(x)
        return out

    def remember(self, embeddings: mx.array, hidden: mx.array, cache: list[Any]) -> list[mx.array]:
        """Write these positions into *cache* as :meth:`__call__` would, without their outputs: the arrays
        to evaluate. A drafter catching up reads the output at its last position only; the others need only
        the keys and values later positions attend to. The last layer's are its input's projections (the
        bytes :meth:`__call__` writes), so its attention and MLP over those positions are skipped: over 8k
        keys, most of what reading 64 positions at once costs."""
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(embeddings),
                                    self.pre_fc_norm_hidden(hidden)], axis=-1))
        *whole, last = self.layers
        if whole:
            mask = create_attention_mask(x, cache[0])
            for layer, layer_cache in zip(whole, cache[:len(whole)], strict=True):
                x = layer(x, mask, layer_cache)
        attention, layer_cache = last.self_attn, cache[len(whole)]
        normed = last.input_layernorm(x)
        batch, length, _ = normed.shape
        heads = attention.num_key_value_heads
        keys = attention.k_norm(attention.k_proj(normed).reshape(batch, length, heads, -1)).transpose(0, 2, 1, 3)
        values = attention.v_proj(normed).reshape(batch, length, heads, -1).transpose(0, 2, 1, 3)
        keys, values = layer_cache.update_and_fetch(attention.rope(keys, offset=layer_cache.offset), values)
        return [keys, values]

    def make_cache(self) -> list[Any]:
        return [KVCache() for _ in self.layers]


def text_args(config: dict[str, Any]) -> TextModelArgs:
    return TextModelArgs.from_dict(config.get("text_config", config))


def build(config: dict[str, Any], weights: dict[str, mx.array], raw_layout: bool) -> Qwen35MTP:
    """The head from its ``mtp.``-stripped *weights*; *raw_layout* adds 1 to zero-centred norms."""
    args = text_args(config)
    head = Qwen35MTP(args, num_layers=_layer_count(config, weights))
    weights = stack_experts(weights)
    head.load_weights(list((shift_norms(weights) if raw_layout else weights).items()), strict=True)
    return head


def stack_experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """A Qwen 3.6 MoE head's experts as mlx-lm's switch MLP holds them.

    Hugging Face stores them fused (``experts.gate_up_proj`` (E, 2I, H) and
    ``experts.down_proj``, as mlx-lm's ``qwen3_5_moe`` sanitize reads them) or one
    by one (``experts.N.{gate,up,down}_proj.weight``); a dense head has neither.
    """
    out = dict(weights)
    for name in [n for n in weights if n.endswith(".mlp.experts.gate_up_proj")]:
        prefix = name[:-len(".experts.gate_up_proj")]
        gate_up = out.pop(name)
        middle = gate_up.shape[-2] // 2
        out[f"{prefix}.switch_mlp.gate_proj.weight"] = gate_up[..., :middle, :]
        out[f"{prefix}.switch_mlp.up_proj.weight"] = gate_up[..., middle:, :]
        out[f"{prefix}.switch_mlp.down_proj.weight"] = out.pop(f"{prefix}.experts.down_proj")
    per_expert = sorted({n.split(".experts.")[0] for n in out if ".mlp.experts." in n})
    for prefix in per_expert:
        for part in ("gate_proj", "up_proj", "down_proj"):
            keys = sorted((n for n in out if n.startswith(f"{prefix}.experts.") and n.endswith(f".{part}.weight")),
                          key=lambda n: int(n.split(".experts.")[1].split(".")[0]))
            out[f"{prefix}.switch_mlp.{part}.weight"] = mx.stack([out.pop(k) for k in keys])
    return out


def shift_norms(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """Hugging Face stores these norms zero-centred; the model (as mlx-lm's) wants 1 + w."""
    return {name: (value + 1.0 if value.ndim == 1 and name.endswith(NORM_SUFFIXES) else value)
            for name, value in weights.items()}


def _layer_count(config: dict[str, Any], weights: dict[str, Any] | None = None) -> int:
    layer_ids = {int(name.split(".")[1]) for name in weights or () if name.startswith("layers.")}
    if layer_ids:
        return len(layer_ids)
    return int(config.get("mtp_num_hidden_layers") or text_config(config).get("mtp_num_hidden_layers") or 1)


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    nested: dict[str, Any] = config.get("text_config", config)
    return nested


# -- the standalone layout (``mlxcel split-mtp``; mlx-community's ``*-MTP-bf16`` directories) ----------

STANDALONE_TYPE = "qwen3_5_mtp"


def standalone_config(target_config: dict[str, Any], block_size: int) -> dict[str, Any]:
    """A standalone head's ``config.json``: the target's text config nested, norms already shifted."""
    text = text_config(target_config)
    tied = bool(text.get("tie_word_embeddings", target_config.get("tie_word_embeddings", False)))
    return {"model_type": STANDALONE_TYPE, "block_size": block_size, "tie_word_embeddings": tied,
            "text_config": {**text, "mtp_num_hidden_layers": _layer_count(target_config)}}


def inventory(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor (name -> shape) a head of *config* holds: what a standalone directory must hold."""
    from mlx.utils import tree_flatten

    head = Qwen35MTP(text_args(config), num_layers=_layer_count(config))
    leaves: list[tuple[str, mx.array]] = tree_flatten(head.parameters())  # type: ignore[assignment]
    return {name: tuple(value.shape) for name, value in leaves}


class Qwen35Drafter:
    """The :class:`~mlxcel.models.speculative.DraftHead` of a Qwen 3.5 target: the head, with the
    target's own embedding and LM head (the head has neither)."""

    def __init__(self, head: Qwen35MTP, target: Any) -> None:
        inner = getattr(target, "language_model", target)
        self.head = head
        self.embed = inner.model.embed_tokens
        self.lm_head = inner.lm_head if hasattr(inner, "lm_head") else self.embed.as_linear

    def new_sequence(self, cache: list[Any]) -> OwnCacheSequence:
        del cache  # the head keeps a cache of its own
        return OwnCacheSequence(self)

    def new_batch(self) -> OwnCacheBatch:
        return OwnCacheBatch(self)
