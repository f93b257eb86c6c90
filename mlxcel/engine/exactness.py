"""The exactness probe: is the burst byte-identical to classic decode on this machine?

Temperature-0 MTP output equals classic output only if every verify computes
the same bytes as the single-token chain (``model(token, cache)``, token after
token), and every rollback lands on the chain's exact cache state. Kernels
choose by shape (a BLAS's matmul by row count, attention by key length), so
the probe covers what rounds actually do: every verify width from 1 (the
burst's own classic steps) to K (rounds narrow near ``max_tokens``), at a short
and a long cache offset, and the state after *every* rollback prefix. It runs
once at boot, on the worker thread, and tries each verify split in turn; the
first exact one is used. Milliseconds to seconds, once per process.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map

from ..models.speculative import DESCRIBE, SPLITS, SpeculativeTarget, Split

#: Cache offsets the probe verifies at: a short prompt, and a long one (bounded by the context).
OFFSETS = (12, 1024)
#: And, for a split whose attention runs the K queries together (``wide``, ``half``), a deep one: how such
#: an attention groups its sums depends on the cache's length, so exactness at 1,024 does not carry to
#: an agent's 10-30k-token prompts. ``rows`` attends a query at a time, as each step does, at any length.
DEEP_OFFSET = 4096
PREFILL_CHUNK = 512
#: A longer prompt is prefilled for this many tokens, then its KV caches repeated to its length (:func:`_repeated_to`).
PREFILLED_BEFORE_REPEATING = 64
_BATCHED_ATTENTION: tuple[Split, ...] = ("wide", "half")


@dataclass(frozen=True, slots=True)
class ProbeResult:
    split: Split | None
    """The verify split that is exact, or None when none is."""
    detail: str | None
    """The one-line reason when the pairing was vetoed (None when exact)."""


def _bytes(array: mx.array) -> np.ndarray:
    """The array's bytes (numpy cannot hold bfloat16, so reinterpret as bytes in MLX first)."""
    return np.array(mx.contiguous(array).view(mx.uint8)).reshape(-1)


def _arrays(cache: list[Any]) -> list[mx.array]:
    """Every cache's state arrays: keys and values up to the offset (a KV buffer holds stale rows
    past it, which a later token overwrites), conv and recurrent states; a cache that knows which of
    its slots a later step can still read says so (``live_state()``, e.g. a sliding-window ring)."""
    def live(c: Any) -> Any:
        if hasattr(c, "live_state"):
            return c.live_state()
        if getattr(c, "keys", None) is not None and c.is_trimmable():  # a quantized cache's are tuples
            return tree_map(lambda x: x[..., :c.offset, :], (c.keys, c.values))
        return c.state

    states = [live(c) for c in cache]
    leaves: list[tuple[str, Any]] = tree_flatten(states)  # type: ignore[assignment]
    return [a for _, a in leaves if isinstance(a, mx.array)]


def _state(cache: list[Any]) -> list[np.ndarray]:
    return [_bytes(a) for a in _arrays(cache)]


def _evaluated(cache: list[Any]) -> list[Any]:
    mx.eval(_arrays(cache))
    return cache


def _compare_logits(got: mx.array, chain: list[np.ndarray], what: str) -> str | None:
    for position in range(got.shape[1]):
        row = _bytes(got[0, position])
        differing = int((row != chain[position]).sum())
        if differing:
            return (f"{what}: position {position} differs from the single-token chain in {differing} of "
                    f"{row.size} logit bytes")
    return None


def _repeated_to(cache: list[Any], depth: int) -> bool:
    """Grow every KV cache in *cache* to *depth* positions by repeating the rows it holds; True when done.

    What the deep case checks is how attention groups its sums over *depth* keys, which the keys'
    values do not change; repeating them spares a real prefill of *depth* tokens, which on a CPU takes
    a hybrid model's recurrent layers token by token (45 s for the 24-layer test pairing). Only
    mlx-lm's plain and quantized KV caches grow so; the fixed-size states of recurrent layers stay as
    they are (no kernel's choice depends on them). Any other cache (a ring, a family's own): False,
    untouched, and the caller prefills for real."""
    from mlx_lm.models.cache import ArraysCache, KVCache, QuantizedKVCache

    growing = [c for c in cache if type(c) in (KVCache, QuantizedKVCache)]
    if not growing or any(type(c) not in (KVCache, QuantizedKVCache, ArraysCache) for c in cache):
        return False
    for c in growing:
        c.keys, c.values = tree_map(lambda x, held=c.offset: _repeat_rows(x, held, depth), (c.keys, c.values))
        c.offset = depth
    return True


def _repeat_rows(x: mx.array, held: int, depth: int) -> mx.array:
    """The first *held* rows of *x* (along its second-to-last axis) repeated to *depth* rows."""
    return mx.concatenate([x[..., :held, :]] * -(-depth // held), axis=-2)[..., :depth, :]


class _Case:
    """One starting state (a prompt of *offset* tokens) and the chain's answers from it.

    A longer prompt than :data:`PREFILLED_BEFORE_REPEATING` is prefilled only that far when the KV caches
    can be grown to its length by repeating their rows (:func:`_repeated_to`)."""

    def __init__(self, model: Any, make_cache: Any, prompt: list[int], block: list[int]) -> None:
        self.base = make_cache()
        done = 0
        if len(prompt) > PREFILLED_BEFORE_REPEATING:
            done = PREFILLED_BEFORE_REPEATING
            model(mx.array([prompt[:done]]), cache=self.base)
            _evaluated(self.base)
            if _repeated_to(self.base, len(prompt)):
                done = len(prompt)
        for start in range(done, len(prompt), PREFILL_CHUNK):
            model(mx.array([prompt[start:start + PREFILL_CHUNK]]), cache=self.base)
            _evaluated(self.base)
        chain = copy.deepcopy(self.base)
        self.logits: list[np.ndarray] = []
        self.states: list[list[np.ndarray]] = []  # the state after each block token
        for token in block:
            logits = model(mx.array([[token]]), cache=chain)
            mx.eval(logits)
            self.logits.append(_bytes(logits[0, -1]))
            self.states.append(_state(_evaluated(chain)))
        self.block = block
        self.offset = len(prompt)

    def difference(self, target: SpeculativeTarget, split: Split) -> str | None:
        where = f"offset {self.offset}"
        one = copy.deepcopy(self.base)
        logits, _ = target.forward(mx.array([self.block[:1]]), one)
        if (found := _compare_logits(logits, self.logits, f"a single-token step at {where}")) is not None:
            return found
        for width in range(2, len(self.block) + 1):
            verified = copy.deepcopy(self.base)
            verify = target.verify(mx.array([self.block[:width]]), verified, split)
            mx.eval(verify.logits)
            _evaluated(verified)
            found = _compare_logits(verify.logits, self.logits, f"a width-{width} verify at {where}")
            if found is not None:
                return found
            for kept in range(1, width + 1):
                rolled = copy.deepcopy(verified)
                target.rollback(rolled, verify, kept)
                if not _equal(_state(_evaluated(rolled)), self.states[kept - 1]):
                    return (f"a width-{width} verify at {where} rolled back to {kept} kept token(s) differs from "
                            f"the single-token chain's cache state")
        return None


def _equal(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def _splits(model: Any, block_size: int) -> tuple[Split, ...]:
    """The splits to try, cheapest first. ``rows`` (the products this BLAS multiplies 2..K rows
    inexactly a row at a time, and the causal attention a query at a time)
    comes before ``half`` when it is the cheaper one on a bandwidth-bound machine: the split shapes'
    share of the weights read K times instead of once, against every weight read twice. ``half`` only
    from K = 3 (at K = 2 it is the chain itself)."""
    from ..models.row_exact import measure

    share = measure(model, block_size).share
    order: list[Split] = ["wide"]
    if share * (block_size - 1) < 1:
        order.append("rows")
    if block_size > 2:
        order.append("half")
    if "rows" not in order:
        order.append("rows")
    assert set(order) <= set(SPLITS)
    return tuple(order)


def probe_exactness(target: SpeculativeTarget, model: Any, make_cache: Any, block_size: int, vocab: int,
                    context_length: int, seed: int = 0, check: Callable[[], None] | None = None) -> ProbeResult:
    """The first verify split under which the burst is byte-identical to classic decode, if any.

    *model* is the served mlx-lm model (``model(tokens, cache=...)`` is classic
    decode); *target* its speculative adapter. Every split is checked at :data:`OFFSETS` (and the target's
    own ``probe_offsets``), one that batches the attention also at :data:`DEEP_OFFSET` (all bounded by the
    context). The splits are tried cheapest first (:func:`_splits`);
    at K = 2 ``half`` is the chain itself, so it is left out. *check* runs
    before each starting state is built and each split is tried, and may raise to abandon the probe.
    """
    check = check or (lambda: None)
    rng = np.random.default_rng(seed)
    deepest = max(1, context_length - block_size - 1)

    def case(offset: int) -> _Case:
        check()
        return _Case(model, make_cache, rng.integers(0, vocab, size=offset).tolist(),
                     rng.integers(0, vocab, size=block_size).tolist())

    # A target may name offsets where its caches change regime (a sliding window filling up).
    wanted = (*OFFSETS, *getattr(target, "probe_offsets", ()))
    splits = _splits(model, block_size)  # measured first: a padded product changes a lone step's bytes too
    cases = [case(offset) for offset in sorted({min(offset, deepest) for offset in wanted})]
    deep: list[_Case] = []  # built when a split that batches the attention first needs it
    failures = []
    for split in splits:
        found = None
        for each in cases:
            check()
            if (found := each.difference(target, split)) is not None:
                break
        if found is None and split in _BATCHED_ATTENTION and min(DEEP_OFFSET, deepest) > cases[-1].offset:
            deep = deep or [case(min(DEEP_OFFSET, deepest))]
            check()
            found = deep[0].difference(target, split)
        if found is None:
            return ProbeResult(split, None)
        failures.append(f"with {DESCRIBE[split]}, {found}")
    detail = "; ".join(failures)
    return ProbeResult(None, detail[0].upper() + detail[1:] + ".")


def probe_batch_widths(target: SpeculativeTarget, model: Any, fresh_cache: list[Any], block_size: int,
                       widths: range, split: Split, vocab: int, seed: int = 0,
                       checked: Callable[[int], None] | None = None) -> dict[int, str]:
    """The batch widths at which a speculative step is not byte for byte the batch's classic steps, each with
    the one-line reason; empty when every width in *widths* is exact.

    Per width B: B rows of different prompt lengths (prefixes of one prompt, each prefilled once, then merged
    as mlx-lm's batch holds them: a left-padded KV cache, stacked recurrent state), then the batch's K classic
    steps (the target's forward over one token a row, as the batch's tap runs them) against one (B, K) verify
    under *split*,
    logit bytes compared at every position. *fresh_cache*: an empty cache of the model, copied per row.
    Rollbacks are checked by the tests (``tests/engine/test_batch_rollback.py``), not here. *checked* is
    called with each width as it is done (progress: a wide batch of a large model takes a minute).
    """
    rng = np.random.default_rng(seed)
    declined: dict[int, str] = {}
    if not widths:
        return declined
    # Every row once, each the one before and 3 tokens more (a hybrid model's recurrent layers prefill a token
    # at a time on a CPU: one prompt's 5 + 3 (rows - 1) tokens, not every row's); each width merges copies.
    prompt = rng.integers(0, vocab, size=5 + 3 * (max(widths) - 1)).tolist()
    prefilled, cache, done = [], copy.deepcopy(fresh_cache), 0
    for row in range(max(widths)):
        model(mx.array([prompt[done:5 + 3 * row]]), cache=cache)
        done = 5 + 3 * row
        prefilled.append(_evaluated(copy.deepcopy(cache)))
    for width in widths:
        rows = copy.deepcopy(prefilled[:width])
        base = [type(layers[0]).merge(list(layers)) for layers in zip(*rows, strict=True)]  # as the batch holds them
        block = mx.array(rng.integers(0, vocab, size=(width, block_size)).tolist())
        chain, steps = copy.deepcopy(base), []
        for position in range(block_size):
            logits, _ = target.forward(block[:, position:position + 1], chain)
            mx.eval(logits)
            steps.append([_bytes(logits[row, 0]) for row in range(width)])
        verify = target.verify(block, copy.deepcopy(base), split)
        mx.eval(verify.logits)
        for position in range(block_size):
            differing = sum(int((_bytes(verify.logits[row, position]) != steps[position][row]).sum())
                            for row in range(width))
            if differing:
                declined[width] = (f"a {width} x {block_size} verify differs from the batch's classic steps at "
                                   f"position {position} in {differing} logit bytes")
                break
        if checked is not None:
            checked(width)
    return declined
