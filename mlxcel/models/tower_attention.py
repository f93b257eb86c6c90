"""The vision towers' attention on the CPU, with its softmax computed by numpy.

MLX's CPU backend computes ``exp`` an element at a time: on this project's x86 machines about 12 ns an
element, against under 1 ns for numpy's vectorised ``exp`` (measured: ``mx.exp`` of 643k floats 7.5 ms, numpy's
0.42 ms). A vision tower's attention is little else: every layer attends over all of an image's patches in both
directions, so Gemma 4's tower over a 1024 x 768 screenshot (2,520 patches, 12 heads, 12 layers) spends about 14 s
of a 26 s request in softmax's ``exp``. Here the scores are multiplied by MLX, as before, and only the softmax
goes through numpy, a head and a block of query rows at a time (about a million scores, so that the softmax's
passes stay in the CPU's cache): 1,327 ms -> 476 ms a layer at that size before the blocks (docs/benchmarks.md).

The towers are mlx-vlm's, and both (Gemma 4's, and Qwen 3-VL's that Qwen 3.5 uses) call mlx-vlm's
``ensure_fused_sdpa``, Gemma's through ``mlx_vlm.models.base`` at each call, Qwen's through the name its module
imported. That name is replaced in both places, once per process, by a dispatcher that takes this path only on
a thread inside :func:`numpy_softmax` whose default device is the CPU; every other caller (another thread, a
GPU, an mlx-vlm user in the same process) gets mlx-vlm's own function. ``ensure_fused_sdpa`` is compiled
(``mx.compile``), and a compiled function's arrays cannot be read by numpy: that is why the name is replaced
rather than ``mx.fast.scaled_dot_product_attention`` beneath it (:mod:`.attention` replaces that one for the
text models' rules).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np

#: The modules whose ``ensure_fused_sdpa`` the towers call (tests/test_mlx_lm_internals.py pins them).
CALLERS = ("mlx_vlm.models.base", "mlx_vlm.models.qwen3_vl.vision")

_thread = threading.local()  # .on: inside numpy_softmax() on this thread
_install_lock = threading.Lock()


@contextmanager
def numpy_softmax() -> Iterator[None]:
    """For the block, mlx-vlm's vision attention on this thread computes its softmax with numpy
    (:func:`attention`), where MLX runs on the CPU. Installs the dispatcher on first use."""
    with _install_lock:
        for name in CALLERS:
            module: Any = importlib.import_module(name)
            if not getattr(module.ensure_fused_sdpa, "mlxcel_dispatch", False):
                module.ensure_fused_sdpa = _dispatching(module.ensure_fused_sdpa)
    outer = getattr(_thread, "on", False)
    _thread.on = mx.default_device() == mx.cpu
    try:
        yield
    finally:
        _thread.on = outer


def _dispatching(original: Any) -> Any:
    def ensure_fused_sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any = None) -> mx.array:
        if getattr(_thread, "on", False):
            return attention(q, k, v, scale, mask)
        return original(q, k, v, scale, mask=mask)

    ensure_fused_sdpa.mlxcel_dispatch = True  # type: ignore[attr-defined]
    ensure_fused_sdpa.__wrapped__ = original  # type: ignore[attr-defined]
    return ensure_fused_sdpa


#: Scores a block holds: a block of query rows at a time keeps its softmax's passes in the CPU's cache (Qwen's
#: tower over a screenshot, 3,072 patches: 883 ms a layer by whole heads, 557 ms by blocks of 256 rows).
BLOCK_SCORES = 1 << 20


def attention(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array | None = None) -> mx.array:
    """``mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)`` for q (B, H, L, D) and k, v
    (B, H_kv, S, D) (H a multiple of H_kv), *mask* None, boolean (True attends) or added to the scores and
    broadcast to (B, H, L, S); the softmax in float32 by numpy, a head and a block of query rows at a time.
    Evaluates as it goes."""
    heads, groups, length, keys = q.shape[1], q.shape[1] // k.shape[1], q.shape[2], k.shape[2]
    rows = max(1, BLOCK_SCORES // max(1, q.shape[0] * keys))
    mx.eval(q, k, v, *([] if mask is None else [mask]))
    outputs = []
    for head in range(heads):
        turned, values = k[:, head // groups].swapaxes(-1, -2), v[:, head // groups]
        blocks = []
        for start in range(0, length, rows):
            scores = (q[:, head, start:start + rows] * scale) @ turned
            if mask is not None:
                masked = mask[:, head if mask.shape[1] > 1 else 0] if mask.ndim == 4 else mask
                masked = masked[..., start:start + rows, :] if masked.shape[-2] > 1 else masked
                scores = mx.where(masked, scores, -np.inf) if masked.dtype == mx.bool_ else scores + masked
            blocks.append(softmax(scores).astype(v.dtype) @ values)
            mx.eval(blocks[-1])
        outputs.append(mx.concatenate(blocks, axis=1) if len(blocks) > 1 else blocks[0])
    return mx.stack(outputs, axis=1)


def softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis, in float32, by numpy (its ``exp`` vectorised), in place on one copy."""
    values = np.array(scores.astype(mx.float32))
    values -= values.max(axis=-1, keepdims=True)
    np.exp(values, out=values)
    values /= values.sum(axis=-1, keepdims=True)
    return mx.array(values)
