"""The burst's greedy choice is classic decode's, to the bit."""

from __future__ import annotations

import mlx.core as mx

from mlxcel.engine.burst import greedy_tokens
from mlxcel.engine.sampling import log_probabilities


def test_the_greedy_token_is_the_argmax_of_classic_decodes_log_probabilities() -> None:
    # bf16 logits whose top two differ by less than the log-probabilities can hold: classic decode
    # (argmax of logits - logsumexp, as a single step computes it) sees a tie and takes the lower
    # index; an argmax of the raw logits would not.
    row = mx.full((250_000,), 2.0, dtype=mx.bfloat16)
    row[7] = 2.015625
    row[3] = 2.0078125
    logits = mx.stack([row, mx.arange(250_000).astype(mx.bfloat16) * 0])[None]  # (1, 2, V)
    classic = [int(mx.argmax(log_probabilities(logits[:, i, :]), axis=-1).item()) for i in range(2)]
    assert greedy_tokens(logits).tolist() == classic
    assert int(mx.argmax(logits[0, 0]).item()) == 7 and classic[0] != 7  # the case is a real one
