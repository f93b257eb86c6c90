"""A lone query on the MLX thread attends grouped by KV head, its keys summed in blocks from the newest: the
same attention as float64's, whatever the padding in front of a row's keys, and only where the rule says."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxcel.models.grouped_attention import CHUNK, grouped, grouped_over


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


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "keys"), [
    (8, 2, 128, 2048), (4, 2, 16, 1500), (6, 3, 64, 1024), (4, 4, 32, 37), (2, 1, 64, 1), (8, 2, 64, CHUNK)])
def test_grouped_is_the_attention(heads: int, kv_heads: int, dim: int, keys: int) -> None:
    q = mx.random.normal((1, heads, 1, dim), key=mx.random.key(0))
    k = mx.random.normal((1, kv_heads, keys, dim), key=mx.random.key(1))
    v = mx.random.normal((1, kv_heads, keys, dim), key=mx.random.key(2))
    scale = dim ** -0.5
    np.testing.assert_allclose(np.array(grouped(q, k, v, scale)), _reference(q, k, v, scale), atol=2e-6)


@pytest.mark.parametrize("keys", [1100, 70])
def test_a_mask_row_and_a_mask_per_head_are_applied(keys: int) -> None:
    heads, kv_heads, dim = 4, 2, 32
    q = mx.random.normal((2, heads, 1, dim), key=mx.random.key(3))
    k = mx.random.normal((2, kv_heads, keys, dim), key=mx.random.key(4))
    v = mx.random.normal((2, kv_heads, keys, dim), key=mx.random.key(5))
    rng = np.random.default_rng(0)
    row = rng.random((2, 1, 1, keys)) < 0.7  # a batch's rows, each with its own padding
    row[..., -1] = True
    per_head = rng.random((2, heads, 1, keys)) < 0.7
    per_head[..., -1] = True
    for keep in (row, per_head, row[0, 0, 0]):
        np.testing.assert_allclose(np.array(grouped(q, k, v, 0.2, mx.array(keep))), _reference(q, k, v, 0.2, keep),
                                   atol=2e-6)
        additive = mx.array(np.where(keep, 0.0, -1e9).astype(np.float32))
        np.testing.assert_allclose(np.array(grouped(q, k, v, 0.2, additive)), _reference(q, k, v, 0.2, keep),
                                   atol=2e-6)


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(8, 2, 64), (2, 1, 128), (4, 4, 64), (16, 2, 256)])
def test_padding_in_front_of_a_row_never_moves_its_bytes(heads: int, kv_heads: int, dim: int) -> None:
    """The same keys behind any amount of masked padding (a batch's left padding, a rollback's rejected
    positions), in a cache of any length, give the same bytes as the keys alone: the property that keeps a
    request's text independent of the batch around it. Rows of one batch carry different padding, and the
    padding holds other keys (stale ones), as a batch's does."""
    rng = np.random.default_rng(7)
    for keys in (1, 5, 37, CHUNK - 1, CHUNK, CHUNK + 1, 200, 700, 1500):
        q = mx.random.normal((3, heads, 1, dim), key=mx.random.key(keys))
        k = mx.random.normal((3, kv_heads, keys, dim), key=mx.random.key(keys + 1))
        v = mx.random.normal((3, kv_heads, keys, dim), key=mx.random.key(keys + 2))
        alone = np.array(grouped(q, k, v, dim ** -0.5))
        for _ in range(3):
            padding = rng.choice([0, 1, 3, 8, 17, CHUNK, 300, 1100], size=3)
            deepest = int(padding.max())
            stale = mx.random.normal((3, kv_heads, deepest, dim), key=mx.random.key(int(padding.sum())))
            padded_k = mx.concatenate([stale, k], axis=2)
            padded_v = mx.concatenate([stale * 3, v], axis=2)
            keep = np.ones((3, 1, 1, deepest + keys), dtype=bool)
            for row, pad in enumerate(padding):
                keep[row, ..., :deepest] = False  # each row's own padding, and more, masked
                keep[row, ..., deepest - pad:deepest] = False
            behind = np.array(grouped(q, padded_k, padded_v, dim ** -0.5, mx.array(keep)))
            np.testing.assert_array_equal(behind, alone, err_msg=f"{keys} keys behind {padding.tolist()}")


def test_every_lone_query_is_grouped_and_nothing_else() -> None:
    calls: list[tuple[int, int, Any]] = []

    def mlx_attention(q: Any, k: Any, v: Any, *, scale: float, mask: Any = None, **kwargs: Any) -> Any:
        calls.append((q.shape[2], k.shape[2], mask))
        return mx.zeros(q.shape)

    attention = grouped_over(mlx_attention)
    q1, q3 = mx.ones((1, 4, 1, 16)), mx.ones((1, 4, 3, 16))
    deep, shallow = mx.ones((1, 2, 2000, 16)), mx.ones((1, 2, 5, 16))
    mha = mx.ones((1, 4, 5, 16))
    assert mx.allclose(attention(q1, deep, deep, scale=0.25), mx.ones((1, 4, 1, 16))).item()  # grouped: no call
    attention(q1, shallow, shallow, scale=0.25, mask="causal")  # the last position: nothing is masked
    attention(q1, shallow, shallow, scale=0.25, mask=mx.zeros((1, 1, 1, 5)))  # a row over the keys
    attention(q1, mha, mha, scale=0.25)  # one query head per KV head: a group of one
    assert not calls
    attention(q3, deep, deep, scale=0.25, mask="causal")  # a block of queries
    attention(q1, deep, deep, scale=0.25, sinks=mx.zeros((4,)))  # attention sinks
    attention(q1, deep, deep, scale=0.25, mask=mx.zeros((1, 1, 2, 2000)))  # not one row per query
    assert [(length, keys) for length, keys, _ in calls] == [(3, 2000), (1, 2000), (1, 2000)]
