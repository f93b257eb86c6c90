"""GLM-4.7-Flash as a speculative target (``glm4_moe_lite``).

Multi-head latent attention (MLA) and mixture-of-experts layers, with a plain
KV cache per layer (mlx-lm's ``KVCache`` holding the normed latent and the
rotary key part): a rollback trims it. The hard part is the verify: for a
block of more than one token mlx-lm's attention takes another formula (it
expands the latent into per-head keys and values) than for a single token
(the query is absorbed into the latent space), so a K-wide forward is not the
single-token chain's bytes. The verify here runs the block's projections and
MLPs over all K rows at once, but attention one query row at a time in the
single-token formula, each row a contiguous array against the keys up to its
own position (decode shape). In a continuous batch the block is (B, K): each
query row is the batch's classic step at that position, every row's left
padding masked as that step masks it; a batch's rollback trims what every row
rejected alike and moves the rest of each row's rejected keys into its padding
(:func:`~mlxcel.models.batch_rollback.rollback_kv_rows`). The MoE's router
gate multiplies through a linear layer, so that :mod:`~mlxcel.models.row_exact`
splits its product as it splits every other. The MoE is left batched (mlx-lm's
switch MLP changes strategy only at 64 routed rows); the exactness probe checks
every width at boot and vetoes the pairing where the bytes differ.

Relies on mlx-lm's ``Glm4MoeLiteAttention`` / decoder layer attribute names
(pinned range in pyproject.toml; the probe and the parity tests fail loudly
when they change).
"""

from __future__ import annotations

import functools
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ...models.batch_rollback import rollback_kv_rows
from ...models.speculative import BlockVerify, Split, split_forward


def _rowwise_attention(attn: Any, x: mx.array, cache: Any) -> mx.array:
    """mlx-lm's ``Glm4MoeLiteAttention`` over a (B, L) block, each query row in its single-token formula."""
    from mlx_lm.models.base import create_causal_mask, scaled_dot_product_attention

    batch, length, _ = x.shape
    q = attn.q_proj(x) if attn.q_lora_rank is None else attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
    q = q.reshape(batch, length, attn.num_heads, attn.q_head_dim).transpose(0, 2, 1, 3)
    q_nope, q_pe = mx.split(q, [attn.qk_nope_head_dim], axis=-1)
    compressed, k_pe = mx.split(attn.kv_a_proj_with_mqa(x), [attn.kv_lora_rank], axis=-1)
    k_pe = k_pe.reshape(batch, length, 1, attn.qk_rope_head_dim).transpose(0, 2, 1, 3)
    latent = mx.expand_dims(attn.kv_a_layernorm(compressed), axis=1)
    offset = cache.offset
    q_pe, k_pe = attn.rope(q_pe, offset), attn.rope(k_pe, offset)
    latents, rotary = cache.update_and_fetch(latent, k_pe)
    start = latents.shape[2] - length  # the keys before the block (a batch's shared index, past its padding)
    padding = getattr(cache, "left_padding", None)  # a batch's rows: each one's unused front
    rows = []
    for row in range(length):
        # A materialised row: a strided view of the block computes other bytes than a decode step's query.
        nope, pe = mx.contiguous(q_nope[:, :, row:row + 1, :]), mx.contiguous(q_pe[:, :, row:row + 1, :])
        end = start + row + 1
        keys = latents[:, :, :end, :]
        pe_scores = (pe * attn.scale) @ rotary[:, :, :end, :].swapaxes(-1, -2)
        if padding is not None:  # the mask the batch's classic step at this position gets from its cache
            mask = create_causal_mask(1, offset=end - 1, left_padding=padding)
            pe_scores = mx.where(mask, pe_scores, mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype))
        out = scaled_dot_product_attention(attn.embed_q(nope), keys, keys, cache=cache, scale=attn.scale,
                                           mask=pe_scores)
        rows.append(attn.unembed_out(out))
    output = mx.concatenate(rows, axis=2).transpose(0, 2, 1, 3).reshape(batch, length, -1)
    projected: mx.array = attn.o_proj(output)
    return projected


def prepare(model: Any) -> None:
    """Give every MoE router gate of *model* its scores through an ``nn.Linear`` sharing the gate's weight.

    mlx-lm's ``MoEGate`` multiplies ``x @ weight.T`` itself, out of :mod:`~mlxcel.models.row_exact`'s reach (it
    measures and splits linear layers only), and an OpenBLAS whose kernel changes at 4 rows (8 x 64 on one machine:
    4 rows against 1) gave a verify's positions other scores than their steps: other expert weights, 302-1,793 logit
    bytes a position. As a linear layer its product is measured and split like every other."""
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or isinstance(gate, nn.Linear) or "scores" in gate:
            continue  # a dense layer's MLP, or done already
        scores = nn.Linear(gate.weight.shape[1], gate.weight.shape[0], bias=False)
        scores.weight = gate.weight  # the same array: nothing copied
        gate.scores = scores
        gate.__class__ = _linear_gate(type(gate))  # type: ignore[arg-type]  # classes hash


@functools.cache
def _linear_gate(base: type) -> type:
    """mlx-lm's gate class, its scores multiplied by its ``scores`` linear layer."""
    from mlx_lm.models.glm4_moe_lite import group_expert_select

    def call(self: Any, x: mx.array) -> Any:
        return group_expert_select(self.scores(x), self.e_score_correction_bias, self.top_k, self.n_group,
                                   self.topk_group, self.routed_scaling_factor, self.norm_topk_prob)

    return type("LinearScoresMoEGate", (base,), {"__call__": call})


class Glm4MoeLiteTarget:
    """The :class:`~mlxcel.models.speculative.SpeculativeTarget` of a GLM-4.7-Flash model.

    Logits exactly as the model's ``__call__`` computes them; hidden is the
    final normed hidden state, which the ``glm4_moe_lite_mtp`` drafter reads
    (the tap upstream measured best).
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        self.body = model.model
        self.lm_head = model.lm_head

    def forward(self, tokens: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        """(logits, hidden) for ``tokens`` of shape (1, S), appended to *cache* (mlx-lm's own forward)."""
        hidden = self.body(tokens, cache)
        return self.lm_head(hidden), hidden

    def _verify_forward(self, tokens: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        if tokens.shape[1] == 1:
            return self.forward(tokens, cache)
        h = self.body.embed_tokens(tokens)
        for layer, layer_cache in zip(self.body.layers, cache, strict=True):
            h = h + _rowwise_attention(layer.self_attn, layer.input_layernorm(h), layer_cache)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        hidden = self.body.norm(h)
        return self.lm_head(hidden), hidden

    def verify(self, tokens: mx.array, cache: list[Any], split: Split) -> BlockVerify:
        """The forward of a (B, K) block under *split*, attention row by row (see the module docstring)."""
        width = tokens.shape[1]
        logits, hidden = split_forward(self._verify_forward, tokens, cache, split, self.model)
        return BlockVerify(logits, hidden, width)

    def rollback(self, cache: list[Any], verify: BlockVerify, kept: int) -> None:
        """Back to the state after the first *kept* tokens of *verify*'s block: trim every KV cache."""
        dropped = verify.width - kept
        if dropped:
            for c in cache:
                c.trim(dropped)

    def rollback_rows(self, cache: list[Any], verify: BlockVerify, kept: list[int]) -> None:
        """A batch's rollback: row i back to the state after the first *kept[i]* tokens of its block."""
        rejected = [verify.width - k for k in kept]
        if any(rejected):
            rollback_kv_rows(cache, rejected)
