"""One sampling chain for every decode path: solo, the batch, and the burst's acceptance rule.

Temperature, top-p, top-k and min-p are applied in one place, with mlx-lm's own
``apply_top_p`` / ``apply_top_k`` / ``apply_min_p``, so that classic decoding samples from
exactly the distribution the speculative sampler preserves. Worker thread only.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

from .requests import GREEDY_BELOW, SamplingParams


def log_probabilities(logits: mx.array) -> mx.array:
    """Classic decode's log-probabilities of logits (1, V): what its greedy argmax and its samplers read.

    The burst computes its own per position with this same function on the same
    (1, V) shape, so that its greedy choice is classic decode's to the bit (in
    bf16 the subtraction can round two logits to one value, and the tie then
    goes to the lower index whatever the raw logits said).
    """
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_BELOW


class SamplingChain:
    """A request's sampler: ``chain(logprobs)`` draws the next token, shape (N,), from (N, V) logprobs.

    Seeded requests carry their own key (split once per draw), so their text
    does not depend on other requests; unseeded ones use MLX's global RNG.
    A ``top_k`` at or above the vocabulary keeps every token, so it is no filter.
    """

    def __init__(self, params: SamplingParams) -> None:
        assert not is_greedy(params), "greedy requests take the argmax, not a sampler"
        self.scale = 1 / params.temperature
        assert math.isfinite(self.scale)
        self.top_p = params.top_p
        self.top_k = params.top_k
        self.min_p = params.min_p
        self._key = mx.random.key(params.seed) if params.seed is not None else None

    def next_key(self) -> mx.array | None:
        if self._key is None:
            return None
        self._key, key = mx.random.split(self._key)
        return key

    def filtered(self, logprobs: mx.array) -> mx.array:
        """*logprobs* with top-p, top-k and min-p applied (excluded tokens at -inf), in mlx-lm's order."""
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        if 0 < self.top_p < 1:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p > 0:
            logprobs = apply_min_p(logprobs, self.min_p)
        if 0 < self.top_k < logprobs.shape[-1]:
            logprobs = apply_top_k(logprobs, self.top_k)
        return logprobs

    def probabilities(self, logits: mx.array) -> mx.array:
        """The distribution (N, V) a draw samples from, for logits (N, V)."""
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)  # (N, V) at once: sampled, not exact
        return mx.softmax(self.filtered(logprobs) * self.scale, axis=-1)

    def __call__(self, logprobs: mx.array) -> mx.array:
        # In float32: 1/temperature can overflow fp16 logits long before float32 ones.
        return mx.random.categorical(self.filtered(logprobs.astype(mx.float32)) * self.scale, key=self.next_key())


class SpeculativeSampler:
    """Speculative sampling for temperature > 0: the output distribution equals the target's.

    The drafter drafts greedily, so its proposal q is a point mass on each
    draft d. The standard rule then reads: accept d with probability
    min(1, p(d) / q(d)) = p(d); on the first rejection, sample from the
    residual max(0, p - q), i.e. p without d, renormalised; if every draft is
    accepted, sample the bonus token from the last position's p. Here p is
    :meth:`SamplingChain.probabilities`, the distribution classic decoding
    samples from. Distribution-exact, not sample-exact: the random stream
    differs from classic decoding's, so a seeded request's text depends on
    whether it ran the burst.
    """

    def __init__(self, chain: SamplingChain) -> None:
        self.chain = chain

    def __call__(self, logits: mx.array, drafts: mx.array) -> tuple[mx.array, mx.array]:
        """(accepted drafts, the token that ends the round) for verify logits (K, V) and drafts (K-1,).

        Both stay on the device: the round is read back once, by the caller.
        """
        probs = self.chain.probabilities(logits.astype(mx.float32))
        count = drafts.shape[0]
        p_draft = probs[mx.arange(count), drafts]
        draws = mx.random.uniform(shape=(count,), key=self.chain.next_key())
        # The number of leading accepted drafts.
        accepted = mx.sum(mx.cumprod((draws < p_draft).astype(mx.int32)))
        row = mx.take(probs, accepted, axis=0)
        rejected = mx.take(mx.concatenate([drafts, mx.array([-1], dtype=drafts.dtype)]), accepted)
        row = mx.where(mx.arange(row.shape[0]) == rejected, 0, row)  # the residual: p without the draft
        return accepted, mx.random.categorical(mx.log(row), key=self.chain.next_key())


def make_sampler(params: SamplingParams) -> SamplingChain | None:
    """None for greedy (the batch then takes the argmax for all greedy rows at once)."""
    return None if is_greedy(params) else SamplingChain(params)


def make_processors(params: SamplingParams, prompt_length: int) -> list[Any]:
    """The logits processors for the bias and penalties of *params* (empty when it has none).

    Each is ``processor(tokens, logits) -> logits``, *tokens* being every token
    of the sequence so far (prompt included, the generated tokens from
    *prompt_length* on), as mlx-lm's ``BatchGenerator`` and ``generate_step``
    call them. mlx-lm's own, except a presence or frequency penalty without a
    context size: OpenAI's, over the whole generated text (:class:`GeneratedTextPenalty`).
    """
    from mlx_lm.sample_utils import make_logits_processors

    if not params.has_processors:
        return []
    # A penalty with a context size is mlx-lm's windowed one; without, OpenAI's over the whole completion.
    presence_windowed = params.presence_context_size is not None
    frequency_windowed = params.frequency_context_size is not None
    processors = make_logits_processors(
        logit_bias=dict(params.logit_bias) or None,
        repetition_penalty=None if params.repetition_penalty == 1.0 else params.repetition_penalty,
        repetition_context_size=params.repetition_context_size,
        presence_penalty=(params.presence_penalty or None) if presence_windowed else None,
        presence_context_size=params.presence_context_size,
        frequency_penalty=(params.frequency_penalty or None) if frequency_windowed else None,
        frequency_context_size=params.frequency_context_size)
    presence = 0.0 if presence_windowed else params.presence_penalty
    frequency = 0.0 if frequency_windowed else params.frequency_penalty
    if presence or frequency:
        processors.append(GeneratedTextPenalty(presence, frequency, prompt_length))
    return processors


class GeneratedTextPenalty:
    """OpenAI's presence and frequency penalties: ``logit[j] -= c[j] * frequency + (c[j] > 0) * presence``, where
    ``c[j]`` counts token j in everything generated so far (the prompt does not count).

    mlx-lm's processors look at a window of the last tokens, prompt included
    (20 by default): a different meaning, kept for requests that name a context size.
    """

    def __init__(self, presence: float, frequency: float, prompt_length: int) -> None:
        self.presence, self.frequency, self.prompt_length = presence, frequency, prompt_length

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        generated = tokens[self.prompt_length:]
        if generated.shape[0] == 0:
            return logits
        counts = mx.zeros((logits.shape[-1],), dtype=mx.float32).at[generated].add(1.0)
        penalty = counts * self.frequency + (counts > 0).astype(mx.float32) * self.presence
        return logits - penalty.astype(logits.dtype)
