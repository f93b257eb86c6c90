"""A lone query over a deep cache attends with its query heads grouped by KV head: the same attention,
and only where the rule says."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.models.grouped_attention import GROUPED_FROM, grouped, grouped_over


def _reference(q: Any, k: Any, v: Any, scale: float, keep: np.ndarray | None = None) -> np.ndarray:
    """Attention in float64 numpy, each query head reading KV head h // (H / KV), over the keys *keep*
    allows (a boolean row, or one per head)."""
    q64, k64, v64 = (np.array(a, dtype=np.float64) for a in (q, k, v))
    rep = q64.shape[1] // k64.shape[1]
    k64, v64 = np.repeat(k64, rep, axis=1), np.repeat(v64, rep, axis=1)
    scores = q64 @ k64.swapaxes(-1, -2) * scale
    if keep is not None:
        scores = np.where(keep, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ v64


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "keys"), [(8, 2, 128, 2048), (4, 2, 16, 1500), (6, 3, 64, 1024)])
def test_grouped_is_the_attention(heads: int, kv_heads: int, dim: int, keys: int) -> None:
    q = mx.random.normal((1, heads, 1, dim), key=mx.random.key(0))
    k = mx.random.normal((1, kv_heads, keys, dim), key=mx.random.key(1))
    v = mx.random.normal((1, kv_heads, keys, dim), key=mx.random.key(2))
    scale = dim ** -0.5
    np.testing.assert_allclose(np.array(grouped(q, k, v, scale)), _reference(q, k, v, scale), atol=2e-6)


def test_a_mask_row_and_a_mask_per_head_are_applied() -> None:
    heads, kv_heads, dim, keys = 4, 2, 32, 1100
    q = mx.random.normal((2, heads, 1, dim), key=mx.random.key(3))
    k = mx.random.normal((2, kv_heads, keys, dim), key=mx.random.key(4))
    v = mx.random.normal((2, kv_heads, keys, dim), key=mx.random.key(5))
    rng = np.random.default_rng(0)
    row = rng.random((2, 1, 1, keys)) < 0.7  # a batch's rows, each with its own padding
    per_head = rng.random((2, heads, 1, keys)) < 0.7
    for keep in (row, per_head):
        np.testing.assert_allclose(np.array(grouped(q, k, v, 0.2, mx.array(keep))), _reference(q, k, v, 0.2, keep),
                                   atol=2e-6)
        additive = mx.array(np.where(keep, 0.0, -1e9).astype(np.float32))
        np.testing.assert_allclose(np.array(grouped(q, k, v, 0.2, additive)), _reference(q, k, v, 0.2, keep),
                                   atol=2e-6)


def test_only_a_lone_grouped_query_over_a_deep_cache_is_grouped() -> None:
    calls: list[tuple[int, int, Any]] = []

    def mlx_attention(q: Any, k: Any, v: Any, *, scale: float, mask: Any = None, **kwargs: Any) -> Any:
        calls.append((q.shape[2], k.shape[2], mask))
        return mx.zeros(q.shape)

    attention = grouped_over(mlx_attention)
    q1, q3 = mx.ones((1, 4, 1, 16)), mx.ones((1, 4, 3, 16))
    deep, shallow = mx.ones((1, 2, GROUPED_FROM, 16)), mx.ones((1, 2, GROUPED_FROM - 1, 16))
    mha = mx.ones((1, 4, GROUPED_FROM, 16))
    assert not calls and attention(q1, deep, deep, scale=0.25).shape == (1, 4, 1, 16)
    assert mx.allclose(attention(q1, deep, deep, scale=0.25), mx.ones((1, 4, 1, 16))).item()  # grouped: no call
    attention(q1, deep, deep, scale=0.25, mask="causal")  # the last position: nothing is masked
    attention(q1, deep, deep, scale=0.25, mask=mx.zeros((1, 1, 1, GROUPED_FROM)))  # a row over the keys
    assert not calls
    attention(q1, shallow, shallow, scale=0.25)  # too shallow
    attention(q3, deep, deep, scale=0.25, mask="causal")  # a block of queries
    attention(q1, mha, mha, scale=0.25)  # one query head per KV head: nothing to group
    attention(q1, deep, deep, scale=0.25, sinks=mx.zeros((4,)))  # attention sinks
    assert [(length, keys) for length, keys, _ in calls] == [
        (1, GROUPED_FROM - 1), (3, GROUPED_FROM), (1, GROUPED_FROM), (1, GROUPED_FROM)]
