"""Qwen 3.5 / 3.6 / 3.8 as a speculative target (``qwen3_5``, ``qwen3_5_text``).

A hybrid model: gated-delta (linear attention) mixers in most layers, full
attention in every ``full_attention_interval``-th. KV caches roll back by
trimming; a gated-delta mixer's conv and recurrent state cannot be trimmed, so
during a verify each mixer runs its per-token recurrence here and keeps its
state after every token (:class:`_SnapshotMixer`): rolling back a partly
accepted round *selects* the state after the last kept token, it recomputes
nothing. The exactness probe checks these states byte for byte against the
single-token chain at boot.

Relies on mlx-lm's ``GatedDeltaNet`` attribute names and its private
``_gated_delta_step_ops`` (pinned range in pyproject.toml; a test fails loudly
when they change).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ...models.batch_rollback import rollback_kv_rows
from ...models.speculative import BlockVerify, Split, split_forward


@dataclass(frozen=True, slots=True)
class _MixerState:
    """A gated-delta mixer's cache state after one token of a verify block."""

    conv_input: mx.array
    """The block's conv input (the previous conv state, then the block's projections)."""
    start: int
    end: int
    """The conv state after this token is ``conv_input[:, start:end]`` (kernel - 1 rows)."""
    recurrent: mx.array

    def cache_arrays(self) -> list[mx.array]:
        # Sliced only for the state a rollback restores: one op, not one per token.
        return [mx.contiguous(self.conv_input[:, self.start:self.end, :]), self.recurrent]


def mixer_inputs(mixer: Any, inputs: mx.array, cache: Any) -> tuple[mx.array, ...]:
    """(q, k, v, a, b, z, conv input) of mlx-lm's ``GatedDeltaNet.__call__`` for one unpadded sequence: its
    projections, its convolution over the cache's conv state and the block, q and k normalized (q scaled)."""
    from mlx_lm.models.gated_delta import normalize_qk

    batch, length, _ = inputs.shape
    qkv = mixer.in_proj_qkv(inputs)
    z = mixer.in_proj_z(inputs).reshape(batch, length, mixer.num_v_heads, mixer.head_v_dim)
    b = mixer.in_proj_b(inputs)
    a = mixer.in_proj_a(inputs)
    keep = mixer.conv_kernel_size - 1
    conv_state = cache[0] if cache[0] is not None else mx.zeros((batch, keep, mixer.conv_dim), dtype=inputs.dtype)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    conv_out = nn.silu(mixer.conv1d(conv_input))
    q, k, v = (t.reshape(batch, length, heads, dim) for t, heads, dim in zip(
        mx.split(conv_out, [mixer.key_dim, 2 * mixer.key_dim], -1),
        [mixer.num_k_heads, mixer.num_k_heads, mixer.num_v_heads],
        [mixer.head_k_dim, mixer.head_k_dim, mixer.head_v_dim], strict=True))
    q, k = normalize_qk(q, k, inv_scale=mixer.head_k_dim ** -0.5, eps=1e-6)
    return q, k, v, a, b, z, conv_input


def _gated_delta_block(mixer: Any, inputs: mx.array, cache: Any,
                       per_token: bool | None = None) -> tuple[mx.array, list[_MixerState]]:
    """mlx-lm's ``GatedDeltaNet.__call__`` for one unpadded sequence, keeping every token's state.

    On the CPU, the same ops in the same order as mlx-lm's CPU path (its
    recurrence is a per-token loop there too). Elsewhere (*per_token*, by default
    when the device is not the CPU), mlx-lm's own ``gated_delta_update`` once per
    token, so that whatever kernel it picks for a single-token step (Metal's on
    Apple GPUs) runs here too. Either way the bytes are the chain's; the
    exactness probe checks that at boot. Returns the output and the state after
    each token.
    """
    from mlx_lm.models.gated_delta import _gated_delta_step_ops, compute_g, gated_delta_update

    if per_token is None:
        per_token = mx.default_device() != mx.cpu

    batch, length, _ = inputs.shape
    q, k, v, a, b, z, conv_input = mixer_inputs(mixer, inputs, cache)
    keep = mixer.conv_kernel_size - 1
    state = cache[1]
    ys, states = [], []
    if per_token:
        for t in range(length):
            y, state = gated_delta_update(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], a[:, t:t + 1],
                                          b[:, t:t + 1], mixer.A_log, mixer.dt_bias, state, None,
                                          use_kernel=not mixer.training)
            ys.append(y[:, 0])
            states.append(_MixerState(conv_input, t + 1, keep + t + 1, state))
    else:
        beta = mx.sigmoid(b)
        g = compute_g(mixer.A_log, a, mixer.dt_bias)
        if state is None:
            state = mx.zeros((batch, mixer.num_v_heads, mixer.head_v_dim, mixer.head_k_dim), dtype=mx.float32)
        if (repeat := mixer.num_v_heads // mixer.num_k_heads) > 1:
            q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
        for t in range(length):
            y, state = _gated_delta_step_ops(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, None)
            ys.append(y)
            states.append(_MixerState(conv_input, t + 1, keep + t + 1, state))
    cache[0], cache[1] = states[-1].cache_arrays()
    cache.advance(length)
    out = mixer.out_proj(mixer.norm(mx.stack(ys, axis=1), z).reshape(batch, length, -1))
    return out, states


class _SnapshotMixer(nn.Module):
    """Wraps a gated-delta mixer: during a verify, keeps the cache state after every token.

    Recurrent state cannot be trimmed like a KV cache, so rolling back a partly
    accepted round restores the state after the last accepted token: a
    selection among states the verify computed anyway, not a recompute.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.states: list[_MixerState] | None = None

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if self.states is None or mask is not None or cache is None or self.inner.sharding_group is not None:
            out: mx.array = self.inner(x, mask, cache)
            return out
        out, states = _gated_delta_block(self.inner, x, cache)
        self.states.extend(states)
        return out


@dataclass(frozen=True, slots=True)
class Qwen35Verify(BlockVerify):
    states: list[list[_MixerState]]
    """For each gated-delta mixer, its cache state after each token of the block."""


class Qwen35Target:
    """The :class:`~mlxcel.models.speculative.SpeculativeTarget` of a Qwen 3.5 model.

    Logits exactly as the model's own ``__call__`` computes them (the text
    model's body, then its LM head or tied embedding); hidden is the final
    normed hidden state, which the ``qwen3_5_mtp`` head reads. Wraps each
    gated-delta mixer (:class:`_SnapshotMixer`) so that a verify keeps its state
    after every token for :meth:`rollback`.
    """

    def __init__(self, model: Any) -> None:
        self.model = model
        inner = getattr(model, "language_model", model)
        self.body = inner.model
        self.embed = self.body.embed_tokens
        self._head = inner.lm_head if hasattr(inner, "lm_head") else None
        self.mixers: list[tuple[int, _SnapshotMixer]] = []
        for index, layer in enumerate(self.body.layers):
            if getattr(layer, "is_linear", False):
                if not isinstance(layer.linear_attn, _SnapshotMixer):  # one wrapper, however many adapters
                    layer.linear_attn = _SnapshotMixer(layer.linear_attn)
                self.mixers.append((index, layer.linear_attn))

    def forward(self, tokens: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        """(logits, hidden) for ``tokens`` of shape (1, S), appended to *cache*."""
        hidden = self.body(tokens, cache)
        # The tied head looked up per call, not bound once: a ``rows`` verify patches ``as_linear``.
        return (self._head(hidden) if self._head is not None else self.embed.as_linear(hidden)), hidden

    def verify(self, tokens: mx.array, cache: list[Any], split: Split) -> Qwen35Verify:
        """The forward of a (1, K) block under *split*, keeping each mixer's state after every token."""
        for _, mixer in self.mixers:
            mixer.states = []
        try:
            width = tokens.shape[1]
            logits, hidden = split_forward(self.forward, tokens, cache, split, self.model)
            states = [mixer.states or [] for _, mixer in self.mixers]
            if any(len(kept) != width for kept in states):
                raise RuntimeError("a gated-delta mixer did not keep its per-token states during the verify "
                                   "(a padded or sharded cache): the burst cannot roll it back")
            return Qwen35Verify(logits, hidden, width, states)
        finally:
            for _, mixer in self.mixers:
                mixer.states = None

    def rollback(self, cache: list[Any], verify: Qwen35Verify, kept: int) -> None:
        """Back to the state after the first *kept* tokens of *verify*'s block."""
        dropped = verify.width - kept
        if dropped == 0:
            return
        for c in cache:
            if c.is_trimmable():
                c.trim(dropped)
        for (index, _), mixer_states in zip(self.mixers, verify.states, strict=True):
            cache[index].cache = mixer_states[kept - 1].cache_arrays()

    def rollback_rows(self, cache: list[Any], verify: Qwen35Verify, kept: Sequence[int]) -> None:
        """A batch's rollback: row i back to the state after the first *kept[i]* tokens of its block.

        Attention layers by :func:`~mlxcel.models.batch_rollback.rollback_kv_rows`; each gated-delta
        mixer takes, per row, the conv window and recurrent state the verify kept after that row's last
        kept token (copies of what the verify computed: nothing is recomputed).
        """
        rejected = [verify.width - k for k in kept]
        if not any(rejected):
            return  # the verify left every row's state after its last token already
        rollback_kv_rows([c for c in cache if c.is_trimmable()], rejected)
        last = [k - 1 for k in kept]  # each row's last kept token, in the block
        ends = mx.array(last)
        for (index, _), states in zip(self.mixers, verify.states, strict=True):
            first = states[0]
            window = ends[:, None] + first.start + mx.arange(first.end - first.start)[None, :]
            conv = mx.take_along_axis(first.conv_input, window[:, :, None], axis=1)
            # Row by row from the state it kept: stacking every token's state to pick one copied them all
            # (0.5 s a step at 16 rows on the 2-core CPU, against 34 ms).
            recurrent = mx.concatenate([states[j].recurrent[i:i + 1] for i, j in enumerate(last)], axis=0)
            cache[index].cache = [conv, recurrent]
