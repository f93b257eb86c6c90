"""The vision towers on the CPU: the two parts MLX's CPU backend computes an element at a time, by numpy.

MLX's CPU backend computes ``exp`` and ``tanh`` an element at a time: on this project's x86 machines 12-25 ns an
element, against about 1 ns for numpy's vectorised functions (``mx.exp`` of 1M floats 12.6 ms, numpy's 0.94 ms).
A vision tower is where that shows: every layer attends over all of an image's patches in both directions (a
softmax over patches x patches, every head) and runs a GELU over patches x its MLP's width. Gemma 4's tower over
a 1024 x 768 screenshot (2,520 patches, 12 heads, 12 layers of 768, MLP 3,072) spent about 16 s of a 26 s request
in the two. Here:

- **attention** (:func:`attention`): the scores multiplied by MLX, as before, and the softmax by numpy, a head
  and a block of query rows at a time (about a million scores, so that the softmax's passes stay in the CPU's
  cache): 1,312 -> 486 ms a layer at that size (docs/benchmarks.md);
- **GELU** (:func:`gelu_approx`, the tanh approximation both towers use): numpy's ``tanh`` in float32, 207 -> 28 ms
  over 2,520 x 3,072 values.

The towers are mlx-vlm's. Both call mlx-vlm's ``ensure_fused_sdpa`` (Gemma's through ``mlx_vlm.models.base`` at
each call, Qwen 3-VL's, which Qwen 3.5 uses, through the name its module imported) and mlx's ``gelu_approx``
(Gemma's MLP as ``mlx.nn.gelu_approx``, Qwen's through ``nn.GELU(approx="tanh")``, which calls its module's
``gelu_approx``). Those names are replaced, once per process, by dispatchers that take these paths only on a
thread inside :func:`numpy_tower` whose default device is the CPU; every other caller (another thread, a GPU, a
text model's MLP, an mlx-vlm user in the same process) gets the library's own function. ``ensure_fused_sdpa`` is
compiled (``mx.compile``), and a compiled function's arrays cannot be read by numpy: that is why its name is
replaced rather than ``mx.fast.scaled_dot_product_attention`` beneath it (:mod:`.attention` replaces that one
for the text models' rules).
"""

from __future__ import annotations

import importlib
import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np

#: Where the towers look up ``ensure_fused_sdpa`` and ``gelu_approx``: those names are replaced (the towers'
#: calls by these names are pinned by tests/engine/test_cpu_tower.py).
ATTENTION_CALLERS = ("mlx_vlm.models.base", "mlx_vlm.models.qwen3_vl.vision")
GELU_CALLERS = ("mlx.nn", "mlx.nn.layers.activations")

_thread = threading.local()  # .on: inside numpy_tower() on this thread
_install_lock = threading.Lock()


@contextmanager
def numpy_tower() -> Iterator[None]:
    """For the block, a vision tower's attention and GELU on this thread run by numpy (:func:`attention`,
    :func:`gelu_approx`), where MLX runs on the CPU. Installs the dispatchers on first use."""
    with _install_lock:
        for names, name, ours in ((ATTENTION_CALLERS, "ensure_fused_sdpa", _attention_call),
                                  (GELU_CALLERS, "gelu_approx", gelu_approx)):
            for module_name in names:
                try:
                    module = importlib.import_module(module_name)
                except ModuleNotFoundError:  # an mlx-vlm without one tower's module: the other is served still
                    continue
                if not getattr(getattr(module, name), "mlxcel_dispatch", False):
                    setattr(module, name, _dispatching(getattr(module, name), ours))
    outer = getattr(_thread, "on", False)
    _thread.on = mx.default_device() == mx.cpu
    try:
        yield
    finally:
        _thread.on = outer


def _dispatching(original: Any, ours: Any) -> Any:
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        return (ours if getattr(_thread, "on", False) else original)(*args, **kwargs)

    dispatch.mlxcel_dispatch = True  # type: ignore[attr-defined]
    dispatch.__wrapped__ = original  # type: ignore[attr-defined]
    return dispatch


def _attention_call(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: Any = None) -> mx.array:
    """:func:`attention` as ``ensure_fused_sdpa(q, k, v, scale, mask=None)`` is called."""
    return attention(q, k, v, scale, mask)


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
    if mask is not None and mask.ndim < 4:  # broadcast as mlx does: (L, S), (H, L, S) -> (1, H, L, S)
        mask = mask.reshape((1,) * (4 - mask.ndim) + tuple(mask.shape))
    mx.eval(q, k, v, *([] if mask is None else [mask]))
    outputs = []
    for head in range(heads):
        turned, values = k[:, head // groups].swapaxes(-1, -2), v[:, head // groups]
        blocks = []
        for start in range(0, length, rows):
            scores = (q[:, head, start:start + rows] * scale) @ turned
            if mask is not None:
                masked = mask[:, head if mask.shape[1] > 1 else 0]
                masked = masked[..., start:start + rows, :] if masked.shape[-2] > 1 else masked
                scores = mx.where(masked, scores, -np.inf) if masked.dtype == mx.bool_ else scores + masked
            blocks.append(softmax(scores).astype(v.dtype) @ values)
            mx.eval(blocks[-1])
        outputs.append(mx.concatenate(blocks, axis=1) if len(blocks) > 1 else blocks[0])
    return mx.stack(outputs, axis=1)


def gelu_approx(x: mx.array) -> mx.array:
    """``mlx.nn.gelu_approx`` (0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))) in float32 by numpy."""
    values = np.array(x.astype(mx.float32))
    inner = values * values
    inner *= values
    inner *= np.float32(0.044715)
    inner += values
    inner *= np.float32(math.sqrt(2 / math.pi))  # float32 scalars: a float64 one would make every pass float64
    np.tanh(inner, out=inner)
    inner += np.float32(1)
    inner *= values
    inner *= np.float32(0.5)
    return mx.array(inner).astype(x.dtype)


def softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis, in float32, by numpy (its ``exp`` vectorised), in place on one copy."""
    values = np.array(scores.astype(mx.float32))
    values -= values.max(axis=-1, keepdims=True)
    np.exp(values, out=values)
    values /= values.sum(axis=-1, keepdims=True)
    return mx.array(values)
