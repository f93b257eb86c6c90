"""The B=1 MTP burst: drafts on device, one K-wide verify, greedy acceptance, rollback.

Runs on the worker thread only. Everything here is exact by construction at
temperature 0 *if* the verify forward computes the same bytes as the
single-token chain; :func:`probe_exactness` checks that once at boot and picks
a verify kernel selection that does.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .requests import BurstStats

Selection = Literal["wide", "half"]
SELECTIONS: tuple[Selection, ...] = ("wide", "half")
DESCRIBE = {
    "wide": "one K-wide verify forward",
    "half": "half-width verify (the K-wide block in two forwards of at most ceil(K/2) tokens)",
}


class _RecordingMixer(nn.Module):
    """Wraps a gated-delta mixer; while recording, keeps the inputs it is called with."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.recorded: list[mx.array] | None = None

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if self.recorded is not None:
            self.recorded.append(x)
        out: mx.array = self.inner(x, mask, cache)
        return out


class TargetModel:
    """The served model as the burst needs it: logits *and* final hidden states.

    For hybrid models it also wraps each gated-delta mixer, so that a verify
    can record the mixers' inputs: rolling back a partly accepted round then
    re-runs only the mixers over the accepted tokens, not the whole model.
    """

    def __init__(self, model: Any) -> None:
        inner = getattr(model, "language_model", model)
        self.body = inner.model
        self.embed = self.body.embed_tokens
        self.lm_head = inner.lm_head if hasattr(inner, "lm_head") else self.embed.as_linear
        self.mixers: list[tuple[int, _RecordingMixer]] = []
        for index, layer in enumerate(self.body.layers):
            if getattr(layer, "is_linear", False):
                layer.linear_attn = _RecordingMixer(layer.linear_attn)
                self.mixers.append((index, layer.linear_attn))

    def forward(self, tokens: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        """(logits, hidden) for ``tokens`` of shape (1, S), appended to *cache*."""
        hidden = self.body(tokens, cache)
        return self.lm_head(hidden), hidden

    def verify(self, tokens: mx.array, cache: list[Any], selection: Selection) -> tuple[mx.array, mx.array]:
        """The verify forward of a (1, K) block under a kernel *selection*."""
        width = tokens.shape[1]
        if selection == "wide" or width <= 2:
            return self.forward(tokens, cache)
        half = (width + 1) // 2
        first = self.forward(tokens[:, :half], cache)
        second = self.forward(tokens[:, half:], cache)
        return (mx.concatenate([first[0], second[0]], axis=1), mx.concatenate([first[1], second[1]], axis=1))


# -- the exactness probe ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProbeResult:
    selection: Selection | None
    """The verify kernel selection that is exact, or None when none is."""
    detail: str | None
    """The one-line reason when the pairing was vetoed (None when exact)."""


def _mismatch(block: mx.array, chain: mx.array) -> tuple[int, int, int] | None:
    """(position, differing bytes, bytes) of the first row where the logits differ, or None."""
    a = np.array(block[0]).view(np.uint8).reshape(block.shape[1], -1)
    b = np.array(chain[0]).view(np.uint8).reshape(chain.shape[1], -1)
    for position in range(a.shape[0]):
        differing = int((a[position] != b[position]).sum())
        if differing:
            return position, differing, a.shape[1]
    return None


def probe_exactness(target: TargetModel, make_cache: Any, block_size: int, vocab: int,
                    trials: int = 3, seed: int = 0) -> ProbeResult:
    """Whether the K-wide verify block gives byte-identical logits to the single-token chain.

    From the same state (a synthetic prompt), on a few synthetic inputs; first
    with one K-wide forward, then, if that differs, with the half-width
    selection. The first exact selection wins.
    """
    rng = np.random.default_rng(seed)
    first_failure: tuple[int, int, int] | None = None
    for selection in SELECTIONS:
        exact = True
        for _ in range(trials):
            prompt = mx.array(rng.integers(0, vocab, size=(1, 12)))
            block = mx.array(rng.integers(0, vocab, size=(1, block_size)))
            cache = make_cache()
            target.forward(prompt, cache)
            mx.eval([c.state for c in cache])
            chain_cache = copy.deepcopy(cache)
            wide, _ = target.verify(block, cache, selection)
            chain = mx.concatenate([target.forward(block[:, i:i + 1], chain_cache)[0]
                                    for i in range(block_size)], axis=1)
            mx.eval(wide, chain)
            mismatch = _mismatch(wide, chain)
            if mismatch is not None:
                exact = False
                first_failure = first_failure or mismatch
                break
        if exact:
            return ProbeResult(selection, None)
    assert first_failure is not None
    position, differing, total = first_failure
    detail = (f"verify block position {position} differs from the single-token chain in {differing} of "
              f"{total} logit bytes. Half-width verify did not make it exact either.")
    return ProbeResult(None, detail)


# -- acceptance ------------------------------------------------------------------------


class SpeculativeSampler:
    """Speculative sampling for temperature > 0: the output distribution equals the target's.

    The drafter drafts greedily, so its proposal distribution q is a point mass
    on each draft d. The standard rule then reads: accept d with probability
    min(1, p(d) / q(d)) = p(d); on the first rejection, sample from the
    residual max(0, p - q), i.e. p without d, renormalised; if every draft is
    accepted, sample the bonus token from the last position's p. Here p is the
    target's distribution after the request's temperature, top-p and top-k,
    exactly as classic decoding samples it.
    """

    def __init__(self, temperature: float, top_p: float, top_k: int, seed: int | None) -> None:
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.key = mx.random.key(seed) if seed is not None else None

    def _next_key(self) -> mx.array | None:
        if self.key is None:
            return None
        self.key, key = mx.random.split(self.key)
        return key

    def distribution(self, logits: mx.array) -> mx.array:
        """Probabilities (N, V) for logits (N, V), with classic decoding's transforms."""
        from mlx_lm.sample_utils import apply_top_k, apply_top_p

        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if 0 < self.top_p < 1:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.top_k > 0:
            logprobs = apply_top_k(logprobs, self.top_k)
        return mx.softmax(logprobs * (1 / self.temperature), axis=-1)

    def __call__(self, logits: mx.array, drafts: list[int]) -> tuple[int, int]:
        """(accepted drafts, the token that ends the round) for verify logits (K, V)."""
        probs = self.distribution(logits.astype(mx.float32))
        count = len(drafts)
        p_draft = probs[mx.arange(count), mx.array(drafts)]
        draws = mx.random.uniform(shape=(count,), key=self._next_key())
        accepted_mask: list[bool] = (draws < p_draft).tolist()  # type: ignore[assignment]
        accepted = next((i for i, ok in enumerate(accepted_mask) if not ok), count)
        row = probs[accepted]
        if accepted < count:
            row = row * (mx.arange(row.shape[0]) != drafts[accepted])  # the residual: p without the draft
        token = mx.random.categorical(mx.log(row), key=self._next_key())
        return accepted, int(token.item())  # type: ignore[arg-type]


# -- the burst ------------------------------------------------------------------------


def _can_trim(cache: list[Any]) -> bool:
    return all(c.is_trimmable() for c in cache)


class Drafter:
    """The MTP head of one sequence: its KV cache and the (hidden, token) pairs not yet fed to it."""

    def __init__(self, head: Any, target: TargetModel) -> None:
        self.head = head
        self.target = target
        self.cache = head.make_cache()
        self.pending_hidden: list[mx.array] = []
        self.pending_tokens: list[mx.array] = []

    def add(self, hidden: mx.array, tokens: mx.array) -> None:
        """Pairs (hidden at position i, token at position i+1), shapes (1, S, H) and (1, S)."""
        self.pending_hidden.append(hidden)
        self.pending_tokens.append(tokens)

    def draft(self, count: int) -> mx.array:
        """*count* greedy drafts, shape (1, count), built on device without a host sync."""
        hidden = mx.concatenate(self.pending_hidden, axis=1)
        tokens = mx.concatenate(self.pending_tokens, axis=1)
        self.pending_hidden, self.pending_tokens = [], []
        out = self.head(self.target.embed(tokens), hidden, self.cache)[:, -1:, :]
        drafts = [mx.argmax(self.target.lm_head(out), axis=-1)]
        for _ in range(count - 1):
            out = self.head(self.target.embed(drafts[-1]), out, self.cache)
            drafts.append(mx.argmax(self.target.lm_head(out), axis=-1))
        return mx.concatenate(drafts, axis=1)

    def forget_chain(self, count: int) -> None:
        """Drop the cache entries of the chained drafts (all but the first of *count*)."""
        if count > 1:
            for c in self.cache:
                c.trim(count - 1)


def run_round(target: TargetModel, cache: list[Any], drafter: Drafter, next_input: int, width: int,
              selection: Selection, stats: BurstStats, timed: bool,
              sampler: SpeculativeSampler | None = None) -> tuple[list[int], list[int]]:
    """One speculative round from the parked state; returns (tokens fed to the target, tokens emitted).

    *width* is the verify width (K, or less near max_tokens). The target is fed
    ``next_input`` and the K-1 drafts in one verify. Greedy (no *sampler*): the
    longest prefix of drafts matching the target's own greedy tokens is
    accepted, plus the target's next token. Sampled: :class:`SpeculativeSampler`.
    Caches are rolled back to exactly the accepted tokens; the last emitted
    token is left unfed (the new ``next_input``).
    """
    started = time.perf_counter()
    drafts = drafter.draft(width - 1)
    if timed:
        mx.eval(drafts)
    drafted = time.perf_counter()
    block = mx.concatenate([mx.array([[next_input]]), drafts.astype(mx.int32)], axis=1)
    trimmable = _can_trim(cache)
    # Recurrent layers (mlx-lm's ArraysCache) cannot be trimmed: keep their state arrays
    # (MLX arrays are immutable; the cache only swaps them) to restore on a partial accept,
    # and record the mixers' inputs to recompute just them over the accepted tokens.
    saved = None if trimmable else [None if c.is_trimmable() else list(c.cache) for c in cache]
    for _, mixer in target.mixers:
        mixer.recorded = []
    try:
        logits, hidden = target.verify(block, cache, selection)
    finally:
        inputs = [mx.concatenate(mixer.recorded or [], axis=1) for _, mixer in target.mixers]
        for _, mixer in target.mixers:
            mixer.recorded = None
    if sampler is None:
        greedy = mx.argmax(logits, axis=-1)
        mx.eval(greedy, drafts)
        target_tokens: list[int] = greedy[0].tolist()  # type: ignore[assignment]
        draft_tokens: list[int] = drafts[0].tolist()  # type: ignore[assignment]
        accepted = 0
        while accepted < width - 1 and draft_tokens[accepted] == target_tokens[accepted]:
            accepted += 1
        last = target_tokens[accepted]
    else:
        draft_tokens = drafts[0].tolist()  # type: ignore[assignment]
        accepted, last = sampler(logits[0], draft_tokens)
    verified = time.perf_counter()
    fed = [next_input, *draft_tokens[:accepted]]
    emitted = [*draft_tokens[:accepted], last]
    rejected = width - 1 - accepted
    if rejected:
        for c in cache:
            if c.is_trimmable():
                c.trim(rejected)
        if not trimmable:
            # Gated-delta state: back to before the verify, then the mixers alone over the
            # accepted tokens (attention caches and hidden states are right already).
            assert saved is not None
            for (index, mixer), recorded in zip(target.mixers, inputs, strict=True):
                cache[index].cache = saved[index]
                mixer.inner(recorded[:, :accepted + 1], None, cache[index])
        hidden = hidden[:, :accepted + 1]
    drafter.forget_chain(width - 1)
    drafter.add(hidden[:, :accepted + 1], mx.array([emitted]))
    finished = time.perf_counter()
    stats.rounds += 1
    stats.proposed += width - 1
    stats.accepted += accepted
    stats.round_seconds += finished - started
    stats.drafter_seconds += drafted - started
    stats.verify_seconds += finished - drafted if not timed else verified - drafted
    return fed, emitted
