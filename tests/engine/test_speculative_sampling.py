"""Speculative sampling emits tokens from the distribution classic decoding samples.

The oracle is independent of the sampler: a float64 numpy transcription of
mlx-lm's classic chain (`make_sampler`: log-softmax, then top-p on the
untempered probabilities, then top-k, then softmax of logprobs / temperature),
itself checked against mlx-lm's `apply_top_p`/`apply_top_k` masks and against
tokens drawn by `make_sampler`. The sampler's own `distribution` is never used.

Agreement is Pearson's chi-square test. Every draw is seeded, so each test
is deterministic; a correct sampler whose random stream changes (say, in a
rewrite) fails a check with probability ALPHA, about 5e-4 over the ~50 checks
here, while the mistakes this guards against (no residual, temperature before
top-p, a filter ignored) give p-values below 1e-8 at these sample sizes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_top_k, apply_top_p, make_sampler

from mlxcel.engine.requests import SamplingParams
from mlxcel.engine.sampling import SamplingChain, SpeculativeSampler


def speculative(temperature: float, top_p: float, top_k: int,
                seed: int) -> Callable[[mx.array, list[int]], tuple[int, int]]:
    """The burst's acceptance rule for one request, read back as (accepted drafts, last token)."""
    sampler = SpeculativeSampler(SamplingChain(SamplingParams(temperature, top_p, top_k, seed)))

    def draw(logits: mx.array, drafts: list[int]) -> tuple[int, int]:
        accepted, token = sampler(logits, mx.array(drafts, dtype=mx.int32))
        mx.eval(accepted, token)  # one evaluation a round, as the engine reads a round back
        return int(accepted.item()), int(token.item())  # type: ignore[arg-type]

    return draw


TRIALS = 4000
VOCAB = 8

#: Per check: the chance that correct sampling with another seed fails it.
ALPHA = 1e-5

#: Upper 0.001 quantiles of the chi-square distribution, from the standard table
#: (NIST/SEMATECH e-Handbook of Statistical Methods, section 1.3.6.7.4): they check chi2_sf.
CHI2_TABLE_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}


def chi2_sf(x: float, dof: int) -> float:
    """P(X >= x) for X chi-square with *dof* degrees of freedom (exact closed forms for integer dof).

    Even dof: exp(-x/2) * sum_{i < dof/2} (x/2)^i / i!. Odd dof:
    erfc(sqrt(x/2)) + sqrt(2x/pi) exp(-x/2) * sum_{r=1}^{(dof-1)/2} x^(r-1) / (3 * 5 * ... * (2r-1)).
    """
    if dof % 2 == 0:
        term = total = 1.0
        for i in range(1, dof // 2):
            term *= x / 2 / i
            total += term
        return math.exp(-x / 2) * total
    total = math.erfc(math.sqrt(x / 2))
    term = math.sqrt(2 * x / math.pi) * math.exp(-x / 2)
    for r in range(1, (dof - 1) // 2 + 1):
        total += term
        term *= x / (2 * r + 1)
    return total


def classic_distribution(logits: np.ndarray, temperature: float, top_p: float, top_k: int) -> np.ndarray:
    """Rows of probabilities classic decoding samples from, for rows of logits.

    As mlx-lm chains it: top-p keeps a token when the mass of the tokens more
    likely than it, at temperature 1, is below top_p; top-k keeps the k most
    likely; the temperature divides the kept logprobs.
    """
    logp = logits.astype(np.float64)
    logp = logp - np.logaddexp.reduce(logp, axis=-1, keepdims=True)
    keep = np.ones(logp.shape, dtype=bool)
    for row, values in enumerate(logp):
        order = np.argsort(-values)
        mass_before = np.cumsum(np.exp(values[order])) - np.exp(values[order])
        if 0 < top_p < 1:
            keep[row, order[mass_before >= top_p]] = False
        if top_k > 0:
            keep[row, order[top_k:]] = False
    scaled = np.where(keep, logp / temperature, -np.inf)
    weights = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
    return weights / weights.sum(axis=-1, keepdims=True)


def chi_square(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic for *counts* drawn from *probs*, and its degrees of freedom.

    Over the support of *probs* only (the caller checks nothing fell outside it).
    Categories expected fewer than 5 times are pooled into one (merged with the
    smallest other category if still under 5), the usual condition for the
    chi-square approximation.
    """
    total = counts.sum()
    expected, observed = total * probs[probs > 0], counts[probs > 0].astype(np.float64)
    small = expected < 5
    bins_e, bins_o = list(expected[~small]), list(observed[~small])
    if small.any():
        pooled_e, pooled_o = expected[small].sum(), observed[small].sum()
        if pooled_e < 5 and bins_e:
            i = int(np.argmin(bins_e))
            bins_e[i] += pooled_e
            bins_o[i] += pooled_o
        else:
            bins_e.append(pooled_e)
            bins_o.append(pooled_o)
    e, o = np.array(bins_e), np.array(bins_o)
    return float(((o - e) ** 2 / e).sum()), len(e) - 1


def assert_follows(counts: np.ndarray, probs: np.ndarray, what: str) -> None:
    outside = counts[probs == 0].sum()
    assert outside == 0, f"{what}: {outside} tokens outside the support"
    statistic, dof = chi_square(counts, probs)
    if dof:
        p_value = chi2_sf(statistic, dof)
        assert p_value > ALPHA, (
            f"{what}: chi-square {statistic:.1f} with {dof} dof, p = {p_value:.2g}; "
            f"observed {np.round(counts / counts.sum(), 3)}, expected {np.round(probs, 3)}")


def _logits(seed: int, rows: int) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=(rows, VOCAB)) * 1.5).astype(np.float32)


@pytest.mark.parametrize(("dof", "critical"), CHI2_TABLE_0_001.items())
def test_chi2_sf_matches_the_published_table(dof: int, critical: float) -> None:
    assert chi2_sf(critical, dof) == pytest.approx(0.001, rel=2e-3)


SETTINGS = [  # (temperature, top_p, top_k)
    (1.0, 1.0, 0), (0.7, 1.0, 0), (1.0, 1.0, 3), (0.8, 0.9, 0), (1.3, 0.8, 5), (0.6, 0.95, 4)]


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), SETTINGS)
def test_the_oracle_is_what_classic_decoding_samples(temperature: float, top_p: float, top_k: int) -> None:
    logits = _logits(0, 3)
    probs = classic_distribution(logits, temperature, top_p, top_k)
    # The kept set is exactly mlx-lm's.
    logp = mx.array(logits) - mx.logsumexp(mx.array(logits), axis=-1, keepdims=True)
    masked = apply_top_p(logp, top_p) if 0 < top_p < 1 else logp
    masked = apply_top_k(masked, top_k) if top_k else masked
    np.testing.assert_array_equal(np.isfinite(np.array(masked)), probs > 0)
    # And mlx-lm's make_sampler, and mlxcel's own chain (which classic decode, solo and batched,
    # samples with), draw from it (one call draws a token for each of TRIALS copies).
    mx.random.seed(3)
    chain = SamplingChain(SamplingParams(temperature, top_p, top_k, seed=5))
    for name, sampler in (("make_sampler", make_sampler(temp=temperature, top_p=top_p, top_k=top_k)),
                          ("SamplingChain", chain)):
        for row in range(len(logits)):
            tokens = np.array(sampler(mx.broadcast_to(logp[row], (TRIALS, VOCAB))))
            assert_follows(np.bincount(tokens, minlength=VOCAB), probs[row], f"{name} row {row}")


def _drafts(probs: np.ndarray, kind: str) -> list[int]:
    """Two drafts; the first by *kind*: the target's likeliest token, its least likely
    kept one, or one that top-p/top-k removed (never acceptable). The second: likely."""
    support = np.flatnonzero(probs[0] > 0)
    first = {"likely": int(np.argmax(probs[0])),
             "unlikely": int(support[np.argmin(probs[0][support])]),
             "removed": int(np.flatnonzero(probs[0] == 0)[0]) if (probs[0] == 0).any() else -1}[kind]
    return [first, int(np.argmax(probs[1]))]


CASES = [(*s, kind) for s in SETTINGS for kind in ("likely", "unlikely", "removed")
         if kind != "removed" or s[1] < 1 or s[2] > 0]

#: Speculative rounds per case. A removed first draft never gets past position 0, and a likely one
#: reaches position 2 in over 240 of 2000 rounds (at least 200 are needed to test a position). At 2000,
#: position 0 still rejects the plain distribution with p < 1e-30, and a sampler without the residual
#: gives an expected p below 1e-90. An unlikely first draft is rarely accepted, so its later positions
#: need the full TRIALS to be tested at all.
ROUNDS = {"likely": 2000, "removed": 2000, "unlikely": TRIALS}


@pytest.mark.parametrize(("temperature", "top_p", "top_k", "kind"), CASES)
def test_every_emitted_token_follows_classic_decoding(temperature: float, top_p: float, top_k: int,
                                                      kind: str) -> None:
    """Position i of a round (given its first i drafts were accepted, i.e. its context
    is the verify block's row i) is distributed as classic decoding at that row."""
    logits = _logits(0, 3)  # K = 3: two drafts and the bonus position
    probs = classic_distribution(logits, temperature, top_p, top_k)
    drafts = _drafts(probs, kind)
    sampler = speculative(temperature, top_p, top_k, seed=11)
    verified = mx.array(logits)
    rounds = [sampler(verified, drafts) for _ in range(ROUNDS[kind])]

    for accepted, token in rounds:
        assert 0 <= accepted <= len(drafts)
        if accepted < len(drafts):
            assert token != drafts[accepted]  # a rejected draft is never resampled
    if kind == "removed":
        assert all(accepted == 0 for accepted, _ in rounds)  # p(draft) = 0: never accepted

    checked = 0
    for position in range(len(drafts) + 1):
        emitted = [drafts[position] if accepted > position else token
                   for accepted, token in rounds if accepted >= position]
        if len(emitted) < 200:  # too few rounds got this far to test
            continue
        counts = np.bincount(np.array(emitted), minlength=VOCAB)
        assert_follows(counts, probs[position], f"position {position}")
        checked += 1
        if position == 0 and (temperature, top_p, top_k) != (1.0, 1.0, 0):
            # The test has teeth: the same tokens are rejected as draws from the
            # distribution without the request's temperature, top-p and top-k.
            plain = classic_distribution(logits, 1.0, 1.0, 0)[0]
            assert chi2_sf(*chi_square(counts, plain)) < ALPHA
    assert checked >= 1


def test_seeded_sampling_is_reproducible_and_the_seed_matters() -> None:
    logits = mx.array(_logits(1, 4))

    def run(seed: int) -> list[tuple[int, int]]:
        sampler = speculative(1.0, 0.9, 0, seed=seed)
        return [sampler(logits, [1, 2, 3]) for _ in range(50)]

    first, again, other = run(5), run(5), run(6)
    assert first == again
    assert first != other
    assert len(set(first)) > 1  # the rounds advance the key: not one draw repeated


def test_a_top_k_beyond_the_vocabulary_keeps_every_token() -> None:
    # mlx-lm's apply_top_k raises for top_k >= vocab; the chain treats it as no filter (it is one).
    logits = _logits(2, 1)
    logp = mx.array(logits) - mx.logsumexp(mx.array(logits), axis=-1, keepdims=True)
    chain = SamplingChain(SamplingParams(1.0, 1.0, 100_000, seed=9))
    tokens = np.array(chain(mx.broadcast_to(logp[0], (TRIALS, VOCAB))))
    assert_follows(np.bincount(tokens, minlength=VOCAB), classic_distribution(logits, 1.0, 1.0, 0)[0], "top_k")
