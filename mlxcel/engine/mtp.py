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


@dataclass(frozen=True, slots=True)
class _MixerState:
    """A gated-delta mixer's cache state after one token of a verify block."""

    conv_input: mx.array
    """The block's conv input (the previous conv state, then the block's projections)."""
    start: int
    end: int
    """The conv state after this token is ``conv_input[:, start:end]`` (kernel - 1 rows)."""
    recurrent: mx.array

    def cache_arrays(self) -> list[mx.array]:
        # Sliced only for the state a rollback restores: one op, not one per token.
        return [mx.contiguous(self.conv_input[:, self.start:self.end, :]), self.recurrent]


def _gated_delta_block(mixer: Any, inputs: mx.array, cache: Any,
                       per_token: bool | None = None) -> tuple[mx.array, list[_MixerState]]:
    """mlx-lm's ``GatedDeltaNet.__call__`` for one unpadded sequence, keeping every token's state.

    On the CPU, the same ops in the same order as mlx-lm's CPU path (its
    recurrence is a per-token loop there too). Elsewhere (*per_token*, by default
    when the device is not the CPU), mlx-lm's own ``gated_delta_update`` once per
    token, so that whatever kernel it picks for a single-token step (Metal's on
    Apple GPUs) runs here too. Either way the bytes are the chain's; the
    exactness probe checks that at boot. Returns the output and the state after
    each token.
    """
    from mlx_lm.models.gated_delta import _gated_delta_step_ops, compute_g, gated_delta_update, normalize_qk

    if per_token is None:
        per_token = mx.default_device() != mx.cpu

    batch, length, _ = inputs.shape
    qkv = mixer.in_proj_qkv(inputs)
    z = mixer.in_proj_z(inputs).reshape(batch, length, mixer.num_v_heads, mixer.head_v_dim)
    b = mixer.in_proj_b(inputs)
    a = mixer.in_proj_a(inputs)
    keep = mixer.conv_kernel_size - 1
    conv_state = cache[0] if cache[0] is not None else mx.zeros((batch, keep, mixer.conv_dim), dtype=inputs.dtype)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    conv_out = nn.silu(mixer.conv1d(conv_input))
    q, k, v = (t.reshape(batch, length, heads, dim) for t, heads, dim in zip(
        mx.split(conv_out, [mixer.key_dim, 2 * mixer.key_dim], -1),
        [mixer.num_k_heads, mixer.num_k_heads, mixer.num_v_heads],
        [mixer.head_k_dim, mixer.head_k_dim, mixer.head_v_dim], strict=True))
    q, k = normalize_qk(q, k, inv_scale=mixer.head_k_dim ** -0.5, eps=1e-6)
    state = cache[1]
    ys, states = [], []
    if per_token:
        for t in range(length):
            y, state = gated_delta_update(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], a[:, t:t + 1],
                                          b[:, t:t + 1], mixer.A_log, mixer.dt_bias, state, None,
                                          use_kernel=not mixer.training)
            ys.append(y[:, 0])
            states.append(_MixerState(conv_input, t + 1, keep + t + 1, state))
    else:
        beta = mx.sigmoid(b)
        g = compute_g(mixer.A_log, a, mixer.dt_bias)
        if state is None:
            state = mx.zeros((batch, mixer.num_v_heads, mixer.head_v_dim, mixer.head_k_dim), dtype=mx.float32)
        if (repeat := mixer.num_v_heads // mixer.num_k_heads) > 1:
            q, k = mx.repeat(q, repeat, -2), mx.repeat(k, repeat, -2)
        for t in range(length):
            y, state = _gated_delta_step_ops(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state, None)
            ys.append(y)
            states.append(_MixerState(conv_input, t + 1, keep + t + 1, state))
    cache[0], cache[1] = states[-1].cache_arrays()
    cache.advance(length)
    out = mixer.out_proj(mixer.norm(mx.stack(ys, axis=1), z).reshape(batch, length, -1))
    return out, states


class _SnapshotMixer(nn.Module):
    """Wraps a gated-delta mixer: during a verify, keeps the cache state after every token.

    Recurrent state cannot be trimmed like a KV cache, so rolling back a partly
    accepted round restores the state after the last accepted token: a
    selection among states the verify computed anyway, not a recompute.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.states: list[_MixerState] | None = None

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if self.states is None or mask is not None or cache is None or self.inner.sharding_group is not None:
            out: mx.array = self.inner(x, mask, cache)
            return out
        out, states = _gated_delta_block(self.inner, x, cache)
        self.states.extend(states)
        return out


class TargetModel:
    """The served model as the burst needs it: logits *and* final hidden states.

    For hybrid models it also wraps each gated-delta mixer (:class:`_SnapshotMixer`)
    so that a verify keeps their state after every token for :meth:`rollback`.
    """

    def __init__(self, model: Any) -> None:
        inner = getattr(model, "language_model", model)
        self.body = inner.model
        self.embed = self.body.embed_tokens
        self.lm_head = inner.lm_head if hasattr(inner, "lm_head") else self.embed.as_linear
        self.mixers: list[tuple[int, _SnapshotMixer]] = []
        for index, layer in enumerate(self.body.layers):
            if getattr(layer, "is_linear", False):
                layer.linear_attn = _SnapshotMixer(layer.linear_attn)
                self.mixers.append((index, layer.linear_attn))

    def forward(self, tokens: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        """(logits, hidden) for ``tokens`` of shape (1, S), appended to *cache*."""
        hidden = self.body(tokens, cache)
        return self.lm_head(hidden), hidden

    def verify(self, tokens: mx.array, cache: list[Any],
               selection: Selection) -> tuple[mx.array, mx.array, list[list[_MixerState]]]:
        """The verify forward of a (1, K) block under a kernel *selection*.

        Returns (logits, hidden, states): *states* holds, for each gated-delta
        mixer, its cache state after each of the K tokens (for :meth:`rollback`).
        """
        for _, mixer in self.mixers:
            mixer.states = []
        try:
            width = tokens.shape[1]
            if selection == "wide" or width <= 2:
                logits, hidden = self.forward(tokens, cache)
            else:
                half = (width + 1) // 2
                first = self.forward(tokens[:, :half], cache)
                second = self.forward(tokens[:, half:], cache)
                logits = mx.concatenate([first[0], second[0]], axis=1)
                hidden = mx.concatenate([first[1], second[1]], axis=1)
            states = [mixer.states or [] for _, mixer in self.mixers]
            if any(len(kept) != width for kept in states):
                raise RuntimeError("a gated-delta mixer did not keep its per-token states during the verify "
                                   "(a padded or sharded cache): the burst cannot roll it back")
            return logits, hidden, states
        finally:
            for _, mixer in self.mixers:
                mixer.states = None

    def rollback(self, cache: list[Any], states: list[list[_MixerState]], kept: int, dropped: int) -> None:
        """Back to the state after the first *kept* tokens of a verify, dropping its last *dropped*."""
        for c in cache:
            if c.is_trimmable():
                c.trim(dropped)
        for (index, _), mixer_states in zip(self.mixers, states, strict=True):
            cache[index].cache = mixer_states[kept - 1].cache_arrays()


# -- the exactness probe ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProbeResult:
    selection: Selection | None
    """The verify kernel selection that is exact, or None when none is."""
    detail: str | None
    """The one-line reason when the pairing was vetoed (None when exact)."""


def _bytes(array: mx.array) -> np.ndarray:
    """The array's bytes (numpy cannot hold bfloat16, so reinterpret as bytes in MLX first)."""
    return np.array(array.view(mx.uint8))


def _difference(block: mx.array, chain: mx.array, states: list[tuple[Any, Any]]) -> str | None:
    """How the verify block's logits or final recurrent states differ from the chain's, or None."""
    a = _bytes(block[0]).reshape(block.shape[1], -1)
    b = _bytes(chain[0]).reshape(chain.shape[1], -1)
    for position in range(a.shape[0]):
        differing = int((a[position] != b[position]).sum())
        if differing:
            return (f"verify block position {position} differs from the single-token chain in {differing} of "
                    f"{a.shape[1]} logit bytes")
    # A rollback restores the states the verify kept: they must match the chain's too.
    if not all(np.array_equal(_bytes(x), _bytes(y)) for x, y in states):
        return "the recurrent state after the verify block differs from the single-token chain's"
    return None


def probe_exactness(target: TargetModel, make_cache: Any, block_size: int, vocab: int,
                    trials: int = 3, seed: int = 0) -> ProbeResult:
    """Whether the K-wide verify block gives byte-identical logits (and recurrent states) to the chain.

    From the same state (a synthetic prompt), on a few synthetic inputs; first
    with one K-wide forward, then, if that differs, with the half-width
    selection. The first exact selection wins.
    """
    rng = np.random.default_rng(seed)
    first_failure: str | None = None
    for selection in SELECTIONS:
        exact = True
        for _ in range(trials):
            prompt = mx.array(rng.integers(0, vocab, size=(1, 12)))
            block = mx.array(rng.integers(0, vocab, size=(1, block_size)))
            cache = make_cache()
            target.forward(prompt, cache)
            mx.eval([c.state for c in cache])
            chain_cache = copy.deepcopy(cache)
            wide, _, _ = target.verify(block, cache, selection)
            chain = mx.concatenate([target.forward(block[:, i:i + 1], chain_cache)[0]
                                    for i in range(block_size)], axis=1)
            states = [pair for index, _ in target.mixers
                      for pair in zip(cache[index].cache, chain_cache[index].cache, strict=True)]
            mx.eval(wide, chain)
            mismatch = _difference(wide, chain, states)
            if mismatch is not None:
                exact = False
                first_failure = first_failure or mismatch
                break
        if exact:
            return ProbeResult(selection, None)
    assert first_failure is not None
    return ProbeResult(None, f"{first_failure}. Half-width verify did not make it exact either.")


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


@dataclass(slots=True)
class PendingRound:
    """A speculative round dispatched to the device and not yet read back."""

    width: int
    next_input: int
    drafts: mx.array
    logits: mx.array
    hidden: mx.array
    states: list[list[_MixerState]]
    started: float


def start_round(target: TargetModel, cache: list[Any], drafter: Drafter, next_input: int, width: int,
                selection: Selection) -> PendingRound:
    """Dispatch one speculative round from the parked state: K-1 drafts and the K-wide verify.

    *width* is the verify width (K, or less near max_tokens): the target is fed
    ``next_input`` and the K-1 drafts. Nothing is read back; the device works
    while the caller does other things, until :func:`finish_round`.
    """
    started = time.perf_counter()
    drafts = drafter.draft(width - 1)
    block = mx.concatenate([mx.array([[next_input]]), drafts.astype(mx.int32)], axis=1)
    logits, hidden, states = target.verify(block, cache, selection)
    mx.async_eval(logits, drafts)
    return PendingRound(width, next_input, drafts, logits, hidden, states, started)


def finish_round(round_: PendingRound, target: TargetModel, cache: list[Any], drafter: Drafter,
                 stats: BurstStats | None, sampler: SpeculativeSampler | None = None) -> tuple[list[int], list[int]]:
    """Read back a dispatched round; returns (tokens fed to the target, tokens emitted).

    Greedy (no *sampler*): the longest prefix of drafts matching the target's
    own greedy tokens is accepted, plus the target's next token. Sampled:
    :class:`SpeculativeSampler`. Caches are rolled back to exactly the accepted
    tokens; the last emitted token is left unfed (the new ``next_input``). The
    round counts in *stats* (its wall time from dispatch to now) unless None.
    """
    width = round_.width
    if sampler is None:
        target_tokens: list[int] = mx.argmax(round_.logits, axis=-1)[0].tolist()  # type: ignore[assignment]
        draft_tokens: list[int] = round_.drafts[0].tolist()  # type: ignore[assignment]
        accepted = 0
        while accepted < width - 1 and draft_tokens[accepted] == target_tokens[accepted]:
            accepted += 1
        last = target_tokens[accepted]
    else:
        draft_tokens = round_.drafts[0].tolist()  # type: ignore[assignment]
        accepted, last = sampler(round_.logits[0], draft_tokens)
    fed = [round_.next_input, *draft_tokens[:accepted]]
    emitted = [*draft_tokens[:accepted], last]
    rejected = width - 1 - accepted
    if rejected:
        target.rollback(cache, round_.states, kept=accepted + 1, dropped=rejected)
    drafter.forget_chain(width - 1)
    drafter.add(round_.hidden[:, :accepted + 1], mx.array([emitted]))
    if stats is not None:
        stats.rounds += 1
        stats.proposed += width - 1
        stats.accepted += accepted
        stats.round_seconds += time.perf_counter() - round_.started
    return fed, emitted
