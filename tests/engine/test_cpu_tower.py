"""The vision towers' attention and GELU by numpy (mlxcel.models.cpu_tower), against mlx's own.

Its effect on whole towers is checked where they are compared with transformers (test_gemma4_vision.py,
test_qwen35_vision.py); here, the function against ``mx.fast.scaled_dot_product_attention`` on the same inputs,
and the dispatchers: which thread gets which function, and that mlx-vlm's towers still call them by the names
they replace.
"""

from __future__ import annotations

import importlib
import inspect
import threading

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxcel.models import cpu_tower
from mlxcel.models.cpu_tower import ATTENTION_CALLERS, attention, gelu_approx, numpy_tower


def _inputs(heads: int, kv_heads: int, length: int, keys: int, dim: int) -> tuple[mx.array, mx.array, mx.array]:
    mx.random.seed(heads * 100 + length)
    return (mx.random.normal((2, heads, length, dim)), mx.random.normal((2, kv_heads, keys, dim)),
            mx.random.normal((2, kv_heads, keys, dim)))


@pytest.mark.parametrize("blocks", [False, True])
@pytest.mark.parametrize("mask_kind", ["none", "additive", "additive per head", "boolean", "2-D", "3-D"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(2, 2), (4, 1)])
def test_attention_equals_mlx_scaled_dot_product_attention(mask_kind: str, heads: int, kv_heads: int, blocks: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    if blocks:  # query rows 5 at a time (the last block shorter), as a screenshot's patches go
        monkeypatch.setattr(cpu_tower, "BLOCK_SCORES", 2 * 45 * 5)
    q, k, v = _inputs(heads, kv_heads, 37, 45, 16)
    mask = {"none": None, "additive": mx.random.normal((2, 1, 37, 45)),
            "additive per head": mx.random.normal((2, heads, 37, 45)),
            "boolean": mx.random.uniform(shape=(2, 1, 37, 45)) > 0.3, "2-D": mx.random.normal((37, 45)),
            "3-D": mx.random.normal((heads, 37, 45))}[mask_kind]
    ours = attention(q, k, v, 0.25, mask)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
    assert ours.shape == theirs.shape == (2, heads, 37, 16)
    np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_in_half_precision_it_is_as_close_to_float32_as_mlxs_own(dtype: mx.Dtype) -> None:
    """Real checkpoints are bf16: numpy has no bf16, so the scores go to float32 and the probabilities back."""
    q, k, v = _inputs(4, 2, 64, 64, 64)
    exact = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125))
    half = [x.astype(dtype) for x in (q, k, v)]
    ours = attention(*half, 0.125)
    theirs = mx.fast.scaled_dot_product_attention(*half, scale=0.125)
    assert ours.dtype == dtype
    ours_error = np.abs(np.array(ours.astype(mx.float32)) - exact).max()
    theirs_error = np.abs(np.array(theirs.astype(mx.float32)) - exact).max()
    assert ours_error <= 1.5 * theirs_error + 1e-3, (ours_error, theirs_error)


def test_a_padding_mask_of_minus_ten_thousand_keeps_padded_keys_out() -> None:
    """Gemma 4's tower masks padded patches with -1e4 (not -inf): their keys get no weight either way."""
    q, k, v = _inputs(2, 2, 8, 8, 16)
    keep = mx.array([True] * 5 + [False] * 3)
    mask = mx.where(keep[None, None, None, :], 0.0, -1e4)
    ours = attention(q, k, v, 1.0, mask)
    alone = attention(q, k[:, :, :5], v[:, :, :5], 1.0)
    np.testing.assert_allclose(np.array(ours), np.array(alone), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("caller", ATTENTION_CALLERS)  # Gemma 4's tower's, Qwen 3-VL's
def test_only_this_thread_inside_the_block_gets_numpys_softmax(caller: str) -> None:
    q, k, v = _inputs(2, 2, 300, 300, 64)
    base = importlib.import_module(caller)
    ours = np.array(attention(q, k, v, 0.125))
    with numpy_tower():
        inside = np.array(base.ensure_fused_sdpa(q, k, v, 0.125))
        elsewhere: list[np.ndarray] = []
        thread = threading.Thread(target=lambda: elsewhere.append(np.array(base.ensure_fused_sdpa(q, k, v, 0.125))))
        thread.start()
        thread.join()
    after = np.array(base.ensure_fused_sdpa(q, k, v, 0.125))
    mlx_own = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125))
    assert not np.array_equal(ours, mlx_own), "the two softmaxes round alike here: the test cannot tell them apart"
    assert np.array_equal(inside, ours)
    assert np.array_equal(elsewhere[0], mlx_own) and np.array_equal(after, mlx_own)


def test_mlx_vlms_towers_call_the_name_that_is_replaced() -> None:
    """mlx-vlm internals: Gemma 4's vision attention imports ``ensure_fused_sdpa`` from ``..base`` at each call,
    Qwen 3-VL's (Qwen 3.5's tower) through its module's global; both take (q, k, v, scale, mask=)."""
    from mlx_vlm.models.gemma4.vision import VisionAttention
    from mlx_vlm.models.qwen3_vl.vision import Attention

    assert "from ..base import ensure_fused_sdpa" in inspect.getsource(VisionAttention.__call__)
    assert "ensure_fused_sdpa(" in inspect.getsource(Attention.__call__)
    for name in ATTENTION_CALLERS:
        function = importlib.import_module(name).ensure_fused_sdpa
        original = getattr(function, "__wrapped__", function)
        parameters = list(inspect.signature(original, follow_wrapped=False).parameters)
        assert parameters[:5] == ["q", "k", "v", "scale", "mask"], f"mlx-vlm's {name}.ensure_fused_sdpa{parameters}"


def test_gelu_approx_equals_mlxs() -> None:
    mx.random.seed(3)
    x = mx.random.normal((64, 96)) * 4
    np.testing.assert_allclose(np.array(gelu_approx(x)), np.array(nn.gelu_approx(x)), rtol=1e-5, atol=1e-6)
    half = x.astype(mx.float16)
    assert gelu_approx(half).dtype == mx.float16


def test_gelu_goes_through_numpy_inside_the_block_only() -> None:
    x = mx.random.normal((300, 500)) * 3
    ours, mlx_own = np.array(gelu_approx(x)), np.array(nn.gelu_approx(x))  # outside the block: mlx's
    assert not np.array_equal(ours, mlx_own), "the two round alike here: the test cannot tell them apart"
    with numpy_tower():
        assert np.array_equal(np.array(nn.gelu_approx(x)), ours)  # Gemma 4's tower MLP calls it so
        assert np.array_equal(np.array(nn.GELU(approx="tanh")(x)), ours)  # Qwen 3-VL's tower MLP so
    assert np.array_equal(np.array(nn.gelu_approx(x)), mlx_own)


def test_mlx_vlms_tower_mlps_call_the_gelu_that_is_replaced() -> None:
    from mlx_vlm.models.gemma4.vision import VisionMLP
    from mlx_vlm.models.qwen3_vl.vision import MLP

    assert "nn.gelu_approx(" in inspect.getsource(VisionMLP.__call__)
    assert 'nn.GELU(approx="tanh")' in inspect.getsource(MLP.__init__)
    assert "gelu_approx(x)" in inspect.getsource(nn.GELU.__call__)
