"""The one place mlxcel replaces mlx's attention, and only for a thread that serves a model.

mlx-lm offers no per-model seam for attention: every family's attention calls
``mx.fast.scaled_dot_product_attention`` by attribute (through
``mlx_lm.models.base``, or directly, as Inkling's does). Two of our rules need
that call: on the CPU a lone query over a deep cache attends with its query
heads grouped (:mod:`.grouped_attention`), and inside a ``rows`` verify a block
of queries attends one query at a time, each as the step at its position would
(:mod:`.row_exact`). So the function is replaced here, once per process, by a
dispatcher that applies the rules only on a thread that declared itself the
MLX thread of a model for a block (:func:`mlx_thread`: the engine's worker for
its life, a sharded follower for its own). Every other thread (a test's
reference decode beside an in-process server, a library user's own mlx-lm calls
in the same process) gets mlx's own attention, untouched.

Which rules apply is the thread's (a ``threading.local``), set and restored by
context managers, so nothing outlives the block that declared it, and a thread
that trio's thread cache hands to other work afterwards attends as mlx does.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .grouped_attention import grouped_over


@dataclass
class _Rules:
    grouped: bool
    """A lone query over a deep cache attends grouped (the CPU backend; GPU backends have fused kernels)."""
    by_queries: bool = False
    """A block of queries over a cache attends one query at a time (a ``rows`` verify is open)."""
    right_justified: bool = False
    """...and a mask array is a continuous batch's: its rows right-justified at one index, so query i of L
    sees no key past the first S - L + i + 1, and the batch's step at that position attended over just those."""


_thread = threading.local()  # .rules: this thread's _Rules while it is an MLX thread, else absent or None
_install_lock = threading.Lock()


@contextmanager
def mlx_thread() -> Iterator[None]:
    """For the block, the calling thread is the MLX thread of the model it serves: its attention goes
    through mlxcel's rules (grouped, on the CPU backend). Installs the dispatcher on first use."""
    import mlx.core as mx

    with _install_lock:
        current = mx.fast.scaled_dot_product_attention
        if not getattr(current, "mlxcel_dispatch", False):
            mx.fast.scaled_dot_product_attention = dispatching(current)
    outer = getattr(_thread, "rules", None)
    _thread.rules = _Rules(grouped=mx.default_device() == mx.cpu)
    try:
        yield
    finally:
        _thread.rules = outer


def on_mlx_thread() -> bool:
    """Whether the calling thread is inside :func:`mlx_thread` (the engine's worker, a sharded follower)."""
    return getattr(_thread, "rules", None) is not None


@contextmanager
def one_query_at_a_time(right_justified: bool = False) -> Iterator[None]:
    """For the block, a causal block of queries (or one under a mask array) attends one query at a
    time on this thread: what a ``rows`` verify needs. *right_justified*: the verify is a continuous
    batch's, whose mask arrays are those of rows right-justified at one index (not a ring's). Only inside
    :func:`mlx_thread`."""
    rules: _Rules | None = getattr(_thread, "rules", None)
    assert rules is not None, "attention one query at a time runs only on an MLX thread (inside mlx_thread())"
    outer = rules.by_queries, rules.right_justified
    rules.by_queries, rules.right_justified = True, right_justified
    try:
        yield
    finally:
        rules.by_queries, rules.right_justified = outer


def dispatching(attention: Any) -> Any:
    """*attention* (mlx's signature) with this thread's rules applied, and *attention* itself on a
    thread outside :func:`mlx_thread`."""
    lone = grouped_over(attention)

    def scaled_dot_product_attention(q: Any, k: Any, v: Any, *, mask: Any = None, **kwargs: Any) -> Any:
        rules: _Rules | None = getattr(_thread, "rules", None)
        if rules is None:
            return attention(q, k, v, mask=mask, **kwargs)
        step = lone if rules.grouped else attention
        if rules.by_queries and q.shape[2] > 1 and (mask == "causal" if isinstance(mask, str) else mask is not None):
            return _each_query(step, q, k, v, mask, rules.right_justified, **kwargs)
        return step(q, k, v, mask=mask, **kwargs)

    scaled_dot_product_attention.mlxcel_dispatch = True  # type: ignore[attr-defined]
    return scaled_dot_product_attention


def _each_query(attention: Any, q: Any, k: Any, v: Any, mask: Any, right_justified: bool, **kwargs: Any) -> Any:
    """q's L queries attending one at a time: under a causal block (the last L of k's S positions), each
    over its own prefix, unmasked; under a continuous batch's mask array (*right_justified*), each over its
    own prefix with its row of the mask; under any other mask array (a sliding window's ring), each over
    every position with its own row of the mask. Each way, what the step at that position computes."""
    import mlx.core as mx

    length, cached = q.shape[2], k.shape[2]
    causal = isinstance(mask, str)
    outputs = []
    for i in range(length):
        end = cached - length + i + 1 if causal or right_justified else cached  # the keys its own step saw
        outputs.append(attention(q[:, :, i:i + 1], k[:, :, :end], v[:, :, :end], **kwargs,
                                 mask=None if causal else mask[..., i:i + 1, :end]))
    return mx.concatenate(outputs, axis=2)
