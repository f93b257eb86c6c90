"""How rank 0 tells the other ranks which forward to run: one small message per model call.

A sharded model is one forward spread over every rank: a pipeline stage
receives the hidden states of the stage before it and sends its own on, and a
tensor-parallel layer sums its partial products across ranks. Every rank must
therefore make the same model calls, with the same shapes, in the same order.
Rank 0's engine decides what to run (which request, which prefill chunk, which
sampled token); the other ranks only follow.

The protocol: before each model call, rank 0 sends a header, four int32s, by an
``all_sum`` to which the followers contribute zeros (the ring backend has no
broadcast; a sum with zeros is one, exactly): the operation, the shape of the
token block, and which cache the call runs on. Then the token block itself goes
the same way. Both are evaluated at once, on every rank, and rank 0 first makes
sure its previous call has run: a model's collectives are not all in the graph
of what a caller reads (rank 0 of a pipeline *receives* its hidden states, so
its own embedding of the tokens is never computed, and a caller that read only
the logits' shape ran nothing), and ranks that wait on different collectives
wait forever. So every rank runs its collectives in one order, and rank 0
dispatches a step only once the step before it has run: the overlap of
single-process decode (the next step queued before the token is read back) is
given up, because a follower cannot start a step before it has the token.

Caches are mirrored by identity, not copied: a call names no cache, the cache
of the call before, or a fresh one. That is all the sharded engine does (one
sequence at a time, no prefix cache, no burst, no rollback), and the leader
refuses anything else rather than let the ranks drift apart.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import mlx.core as mx

logger = logging.getLogger(__name__)

# Header operations. Zero is never sent: a header of zeros would mean a follower summed only zeros.
STOP = 1
FORWARD = 2

# Which cache a FORWARD runs on.
NO_CACHE = 0
SAME_CACHE = 1
FRESH_CACHE = 2

_HEADER = 4


def _share(values: Any, group: Any) -> Any:
    """Rank 0's *values* on every rank (the others pass zeros of the same shape)."""
    return mx.distributed.all_sum(values, group=group)


class Leader:
    """Rank 0's model: every call first tells the followers what it is, then runs.

    Stands in for the model wherever the engine uses it; attributes other than
    the call are the model's own (``layers``, ``make_cache``, ``parameters``, ...).
    """

    def __init__(self, model: Any, group: Any) -> None:
        self._model = model
        self._group = group
        self._cache: weakref.ref[Any] | None = None  # the first layer's cache of the last call
        self._last: Any = None  # the last call's output, until it is known to have run
        self._stopped = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, inputs: Any, cache: list[Any] | None = None, **kwargs: Any) -> Any:
        if self._stopped:
            raise RuntimeError("the followers have been stopped; the sharded model cannot run")
        if kwargs:
            raise TypeError(f"a sharded model takes only tokens and a cache, not {sorted(kwargs)}")
        if inputs.ndim != 2:
            raise ValueError(f"a sharded model takes a (batch, length) token block, not shape {inputs.shape}")
        which = self._which_cache(cache)
        rows, length = inputs.shape
        self._send(FORWARD, rows, length, which)
        shared = _share(inputs.astype(mx.int32), self._group)
        mx.eval(shared)
        self._last = self._model(shared, cache=cache)
        return self._last

    def _send(self, *header: int) -> None:
        """The previous call's collectives first (a no-op once it was evaluated), then the header."""
        last, self._last = self._last, None
        if last is not None:
            mx.eval(last)
        mx.eval(_share(mx.array(header, dtype=mx.int32), self._group))

    def _which_cache(self, cache: list[Any] | None) -> int:
        if cache is None:
            return NO_CACHE
        last = self._cache() if self._cache is not None else None
        if last is cache[0]:
            return SAME_CACHE
        if not all(layer.empty() for layer in cache):
            # A cache the followers never saw filled (a prefix-cache hit): they cannot mirror it.
            raise RuntimeError("a sharded model can only start a sequence from an empty cache")
        self._cache = weakref.ref(cache[0])
        return FRESH_CACHE

    def stop(self) -> None:
        """Tell the followers to exit. Once; later calls do nothing."""
        if self._stopped:
            return
        self._stopped = True
        self._send(STOP, 0, 0, 0)
        logger.info("told the other %d rank(s) to stop", self._group.size() - 1)


def follow(model: Any, group: Any) -> int:
    """Run rank 0's model calls on this rank's shard until it says stop; the number of calls run."""
    from mlx_lm.models.cache import make_prompt_cache

    cache: list[Any] | None = None
    calls = 0
    while True:
        header = _share(mx.zeros((_HEADER,), dtype=mx.int32), group).tolist()
        op, rows, length, which = header
        if op == STOP:
            return calls
        if op != FORWARD or rows < 1 or length < 1 or which not in (NO_CACHE, SAME_CACHE, FRESH_CACHE):
            raise RuntimeError(f"rank 0 sent a header this rank cannot read: {header}")
        if which == FRESH_CACHE:
            cache = make_prompt_cache(model)
        elif which == SAME_CACHE and cache is None:
            raise RuntimeError("rank 0 continued a cache this rank never started")
        used = cache if which != NO_CACHE else None
        tokens = _share(mx.zeros((rows, length), dtype=mx.int32), group)
        mx.eval(tokens)
        out = model(tokens, cache=used)
        mx.eval(out, *([layer.state for layer in used] if used is not None else []))
        calls += 1
