"""A long prefill's gated-delta recurrence in chunks: matrix products instead of a step per token (CPU only).

mlx-lm runs the recurrence of Qwen 3.5's linear-attention layers a token at a time wherever it has no Metal
kernel (this CPU, CUDA): a prompt of ``L`` tokens is ``L`` dependent steps of small ops per layer. Per token
``t``, with decay ``g_t``, write strength ``beta_t``, and state ``S`` (values x keys)::

    u_t = beta_t (v_t - g_t S_{t-1} k_t)        S_t = g_t S_{t-1} + u_t k_t^T        y_t = S_t q_t

Within a chunk of ``C`` tokens starting from ``S0``, with ``G_t`` the decays' running product inside it,
``S_{t-1}`` unrolls into ``S0`` and the chunk's earlier ``u_i``; the ``u`` then solve one unit lower-triangular
system, ``(I + A) U = beta V - beta G K S0^T`` with ``A_ti = beta_t (G_t / G_i) k_t . k_i`` (i < t), and
``Y = G Q S0^T + ((G_t / G_i) q_t . k_i, i <= t) U``, ``S_C = G_C S0 + sum_i (G_C / G_i) u_i k_i^T``: a few
matrix products a chunk, ``L / C`` dependent steps. The same state and outputs to float rounding (not byte for
byte: the sums go in another order), so it is used only where nothing compares bytes against a token-by-token
run: an image prompt's prefill (:mod:`.vision`), which always splits the same way on a cache hit as on a miss.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import mlx.nn as nn

CHUNK = 64


def chunked_delta(q: mx.array, k: mx.array, v: mx.array, log_decay: mx.array, beta: mx.array,
                  state: mx.array | None) -> tuple[mx.array, mx.array]:
    """(outputs (B, L, H, Dv), the state after) of the recurrence above from *state* (B, H, Dv, Dk; None: zeros),
    for *q*, *k* (B, L, H, Dk), *v* (B, L, H, Dv), *log_decay* and *beta* (B, L, H); float32 inside."""
    batch, length, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    pad = -length % CHUNK  # padded tokens write nothing (beta 0) and keep the state (decay 1)
    chunks = (length + pad) // CHUNK

    def split(x: mx.array) -> mx.array:  # (B, L, H, ...) -> (B, H, N, C, ...)
        x = mx.pad(x.astype(mx.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(batch, chunks, CHUNK, heads, *x.shape[3:])
        return mx.moveaxis(x, 3, 1)

    q, k, v, log_decay, beta = (split(x) for x in (q, k, v, log_decay, beta))
    running = mx.cumsum(log_decay, axis=-1)  # log G_t inside each chunk
    gaps = running[..., :, None] - running[..., None, :]  # log (G_t / G_i)
    lower = mx.tril(mx.ones((CHUNK, CHUNK), dtype=mx.bool_))
    ratio = mx.where(lower, mx.exp(mx.where(lower, gaps, 0.0)), 0.0)  # G_t / G_i for i <= t, else 0
    strict = mx.tril(mx.ones((CHUNK, CHUNK), dtype=mx.bool_), k=-1)
    a = mx.where(strict, beta[..., :, None] * ratio * (k @ mx.swapaxes(k, -1, -2)), 0.0)
    solve = mx.linalg.tri_inv(a + mx.eye(CHUNK), upper=False, stream=mx.cpu)
    written = solve @ (beta[..., None] * v)  # U's part from V
    carried = solve @ (beta[..., None] * mx.exp(running)[..., None] * k)  # U's part from S0: minus this S0^T
    attention = ratio * (q @ mx.swapaxes(k, -1, -2))
    s = mx.zeros((batch, heads, value_dim, key_dim), dtype=mx.float32) if state is None else state.astype(mx.float32)
    outputs = []
    for n in range(chunks):
        s_t = mx.swapaxes(s, -1, -2)  # (B, H, Dk, Dv)
        u = written[:, :, n] - carried[:, :, n] @ s_t
        outputs.append((mx.exp(running[:, :, n])[..., None] * q[:, :, n]) @ s_t + attention[:, :, n] @ u)
        to_end = mx.exp(running[:, :, n, -1:] - running[:, :, n])  # G_C / G_i
        s = mx.exp(running[:, :, n, -1])[..., None, None] * s + mx.swapaxes(u * to_end[..., None], -1, -2) @ k[:, :, n]
    y = mx.stack(outputs, axis=2).reshape(batch, heads, chunks * CHUNK, value_dim)[:, :, :length]
    return mx.moveaxis(y, 1, 2), s


class _ChunkedMixer(nn.Module):
    """mlx-lm's ``GatedDeltaNet`` with its recurrence in chunks (:func:`chunked_delta`) for one unpadded
    sequence with a cache; anything else (a batch's mask, a sharded layer) goes to the layer itself."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        from .target import mixer_inputs

        mixer = self.inner
        if mask is not None or cache is None or mixer.sharding_group is not None:
            out: mx.array = mixer(x, mask, cache)
            return out
        batch, length, _ = x.shape
        q, k, v, a, b, z, conv_input = mixer_inputs(mixer, x, cache)
        if (repeat := mixer.num_v_heads // mixer.num_k_heads) > 1:
            q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
        log_decay = -mx.exp(mixer.A_log.astype(mx.float32)) * nn.softplus(a + mixer.dt_bias)
        y, state = chunked_delta(q, k, v, log_decay, mx.sigmoid(b), cache[1])
        cache[0] = mx.contiguous(conv_input[:, -(mixer.conv_kernel_size - 1):, :])
        cache[1] = state
        cache.advance(length)
        return mixer.out_proj(mixer.norm(y.astype(x.dtype), z).reshape(batch, length, -1))


@contextmanager
def chunked_recurrence(body: Any) -> Iterator[None]:
    """Calls of *body* (mlx-lm's ``Qwen3_5TextModel``, worker thread only) run each linear-attention layer's
    recurrence in chunks inside the block, on the CPU (elsewhere mlx-lm's own: Metal's kernel on Apple GPUs)."""
    layers = [layer for layer in body.layers if getattr(layer, "is_linear", False)]
    if mx.default_device() != mx.cpu or not layers:
        yield
        return
    originals = [layer.linear_attn for layer in layers]
    try:
        for layer, mixer in zip(layers, originals, strict=True):
            layer.linear_attn = _ChunkedMixer(getattr(mixer, "inner", mixer))  # past the verify's wrapper
        yield
    finally:
        for layer, mixer in zip(layers, originals, strict=True):
            layer.linear_attn = mixer
