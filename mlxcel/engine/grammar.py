"""Grammar-constrained decoding: llguidance's matcher as an mlx-lm logits processor. Worker thread only.

A request with a grammar (``response_format``, a forced tool call) gets a
:class:`GrammarProcessor` among its logits processors: before each sampling
step it lets the matcher consume the tokens generated since its last call and
sets every token the grammar forbids next to ``-inf``. Once the grammar is
complete only the end-of-sequence tokens are allowed. Like every logits
processor it makes the request decode classically (never the MTP burst), in
solo decode and in the batch alike, and it moves with the sequence from one to
the other: it reads the tokens from the context it is given, not from its own
count of calls.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import numpy as np

logger = logging.getLogger(__name__)


def grammar_tokenizer(tokenizer: Any, vocab_size: int, eos_tokens: frozenset[int]) -> Any:
    """llguidance's view of *tokenizer* (mlx-lm's wrapper of a Hugging Face tokenizer), or, when there can
    be none, a sentence saying why (it is not a fast one: llguidance reads the Rust tokenizer's JSON).

    *vocab_size* is the width of the model's logits; the table is as wide as
    the wider of it and the tokenizer (logits are often padded beyond the
    vocabulary: those ids are never allowed; a vocabulary wider than the
    logits has ids the model never produces, cut off the mask). Built once,
    at load: it walks the whole vocabulary (about a second for 150k tokens)
    holding the GIL, which would stall every decoding sequence if it ran
    later, on whatever thread. The HTTP layer compiles matchers with it.
    """
    import llguidance.hf

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    if not hasattr(hf, "backend_tokenizer"):
        return (f"constrained decoding needs a Hugging Face fast tokenizer, and this model's is "
                f"{type(hf).__name__}")
    try:
        width = max(vocab_size, hf.backend_tokenizer.get_vocab_size(with_added_tokens=True))
        return llguidance.hf.from_tokenizer(hf, n_vocab=width, eos_token=sorted(eos_tokens))
    except Exception as exc:  # a vocabulary llguidance cannot tabulate must not stop the server
        logger.warning("constrained decoding is unavailable: llguidance cannot read the tokenizer (%s: %s)",
                       type(exc).__name__, exc)
        return f"llguidance cannot read this model's tokenizer: {exc}"



class GrammarError(RuntimeError):
    """The matcher cannot go on (a token it did not allow, or a resource limit of the grammar)."""


class GrammarProcessor:
    """``processor(tokens, logits) -> logits`` that keeps only the tokens *matcher*'s grammar allows next.

    *matcher* is an llguidance ``LLMatcher`` at the start of its grammar,
    compiled by the HTTP layer (compiling here would stall every sequence).
    *prompt_length* is where the generated tokens start in the context the
    decode paths pass (every token of the sequence so far, prompt included).
    """

    def __init__(self, matcher: Any, prompt_length: int) -> None:
        self.matcher = matcher
        self.prompt_length = prompt_length
        self.consumed = 0
        """Generated tokens the matcher has consumed."""

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        generated = tokens.shape[0] - self.prompt_length
        if self.matcher.is_stopped():
            # The grammar is complete and its end-of-sequence token sampled: the sequence is over, and
            # this is the step a pipelined decode path queues behind it, whose token is never used.
            return logits
        if generated > self.consumed:
            new: list[int] = tokens[self.prompt_length + self.consumed:].tolist()  # type: ignore[assignment]
            if not self.matcher.consume_tokens(new):
                raise GrammarError(f"the output left its grammar: {self.matcher.get_error()}")
            self.consumed = generated
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar cannot go on: {self.matcher.get_error()}")
        width = logits.shape[-1]
        allowed = np.unpackbits(words, bitorder="little")[:width].astype(np.bool_)
        return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, dtype=logits.dtype))
