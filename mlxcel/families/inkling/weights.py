"""Inkling's raw checkpoint names (``model.llm.*``, and an MTP block's ``transformer_block.*``) in the names of
mlxcel's model file: renamed, interleaved gate/up pairs split, convolutions transposed."""

from __future__ import annotations

import mlx.core as mx

_RENAMES = (("attn.wq_du.", "self_attn.q_proj."), ("attn.wk_dv.", "self_attn.k_proj."),
            ("attn.wv_dv.", "self_attn.v_proj."), ("attn.wr_du.", "self_attn.r_proj."),
            ("attn.wo_ud.", "self_attn.o_proj."), ("attn.q_norm.", "self_attn.q_norm."),
            ("attn.k_norm.", "self_attn.k_norm."), ("attn.k_sconv.", "self_attn.k_sconv."),
            ("attn.v_sconv.", "self_attn.v_sconv."), ("attn.rel_logits_proj.proj", "self_attn.rel_proj"),
            ("attn_norm.", "input_layernorm."), ("mlp_norm.", "post_attention_layernorm."),
            ("mlp.w2_md.", "mlp.down_proj."), ("mlp.experts.w2_weight", "mlp.switch_mlp.down_proj.weight"))


def _deinterleave(w: mx.array, axis: int) -> tuple[mx.array, mx.array]:
    """Rows stored gate, up, gate, up, ... along *axis* -> (gate, up)."""
    shape = list(w.shape)
    pairs = w.reshape(*shape[:axis], shape[axis] // 2, 2, *shape[axis + 1:])
    return mx.take(pairs, 0, axis=axis + 1), mx.take(pairs, 1, axis=axis + 1)


def remap_layer_weights(key: str, value: mx.array, prefix: str) -> dict[str, mx.array]:
    """One raw tensor under ``model.llm.`` (or an MTP block's ``transformer_block.``) in this file's names.

    Interleaved gate/up pairs are split, a convolution's (channels, 1, kernel) becomes (kernel, channels).
    """
    if key in ("embed.weight", "unembed.weight"):
        return {("model.embed_tokens.weight" if key.startswith("embed") else "lm_head.weight"): value}
    for old, new in _RENAMES:
        key = key.replace(old, new)
    if key.endswith("sconv.weight") and value.ndim == 3:
        return {prefix + key: value[:, 0, :].T}
    if key.endswith("mlp.w13_dn.weight"):
        gate, up = _deinterleave(value, 0)
        base = prefix + key.removesuffix("w13_dn.weight")
        return {base + "gate_proj.weight": gate, base + "up_proj.weight": up}
    if key.endswith("mlp.experts.w13_weight"):
        gate, up = _deinterleave(value, 1)
        base = prefix + key.removesuffix("experts.w13_weight") + "switch_mlp."
        return {base + "gate_proj.weight": gate, base + "up_proj.weight": up}
    if key.endswith("shared_experts.shared_w13_weight"):
        gate, up = _deinterleave(value, 1)
        base = prefix + key.removesuffix("shared_w13_weight")
        return {f"{base}{n}.{name}_proj.weight": w[n] for n in range(value.shape[0])
                for name, w in (("gate", gate), ("up", up))}
    if key.endswith("shared_experts.shared_w2_weight"):
        base = prefix + key.removesuffix("shared_w2_weight")
        return {f"{base}{n}.down_proj.weight": value[n] for n in range(value.shape[0])}
    return {prefix + key: value}
