"""Grammar-constrained decoding: llguidance's matcher as an mlx-lm logits processor. Worker thread only.

A request with a grammar (``response_format``, a forced tool call) gets a
:class:`GrammarProcessor` among its logits processors: before each sampling
step it lets the matcher consume the tokens generated since its last call and
sets every token the grammar forbids next to ``-inf``. Once the grammar is
complete only the end-of-sequence tokens are allowed. It moves with the
sequence between solo decode, the batch and the MTP burst: it reads the tokens
from the context it is given, not from its own count of calls. The burst asks
for one mask per verify position at once (:meth:`GrammarProcessor.draft_masks`)
and rolls the matcher back to the drafts it kept (:meth:`GrammarProcessor.rollback`).
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
    """The matcher cannot go on (a token it did not allow, or a resource limit of the grammar): the request's
    fault, answered 400. Its message is one line: llguidance's error text goes on with the matcher's state and
    the whole grammar (the request's schema, the text generated so far), which is request content and stays
    out of answers and logs."""


def _first_line(matcher: Any) -> str:
    return (str(matcher.get_error()).strip().splitlines() or ["(no reason given)"])[0][:200]


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
        self.deferring = False
        """In the batch: a failure is kept in :attr:`failure` instead of raised, since a raise there would end
        the whole batch step, every other sequence's too. The worker ends this one after the step."""
        self.failure: GrammarError | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.failure is not None:
            return logits  # this sequence ends after the step; its token is never used
        if not self.deferring:
            return self._masked(tokens, logits)
        try:
            return self._masked(tokens, logits)
        except GrammarError as exc:
            self.failure = exc
            return logits

    def _masked(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.matcher.is_stopped():
            # The grammar is complete and its end-of-sequence token sampled: the sequence is over, and
            # this is the step a pipelined decode path queues behind it, whose token is never used.
            return logits
        generated = tokens.shape[0] - self.prompt_length
        if generated > self.consumed:
            new: list[int] = tokens[self.prompt_length + self.consumed:].tolist()  # type: ignore[assignment]
            self._consume(new)
        return self.apply(self._allowed(logits.shape[-1]), logits)

    def draft_masks(self, context: list[int], drafts: list[int], width: int) -> tuple[list[np.ndarray], int]:
        """The masks of a verify whose position i follows *context* + ``drafts[:i]``, as far as they matter.

        Mask i is the one a classic step would apply after *context* (every
        token so far, the round's input included) and ``drafts[:i]``: each
        draft its position's mask allows is consumed and the next position's
        mask computed. A draft its mask forbids can never be the masked argmax
        nor be sampled from the masked distribution, so the round keeps
        nothing past it: the masks stop there. They stop too where the
        matcher has stopped (the grammar complete, or its end of sequence
        consumed): from there a classic step masks nothing and consumes
        nothing either. Returns the masks and how many drafts the matcher
        consumed; :meth:`rollback` takes back those the round did not keep.
        """
        if self.matcher.is_stopped():
            return [], 0
        self._consume(context[self.prompt_length + self.consumed:])
        masks = [self._allowed(width)]
        consumed = 0
        for draft in drafts:
            if self.matcher.is_stopped() or not masks[-1][draft]:
                break
            self._consume([draft])
            consumed += 1
            masks.append(self._allowed(width))
        return masks, consumed

    def rollback(self, count: int) -> None:
        """Take back the last *count* tokens consumed (drafts the burst did not keep)."""
        if count and not self.matcher.rollback(count):
            raise GrammarError(f"the matcher cannot roll back {count} tokens: {_first_line(self.matcher)}")
        self.consumed -= count

    @staticmethod
    def apply(allowed: np.ndarray, logits: mx.array) -> mx.array:
        """*logits* with every token that *allowed* (bools, the logits' width) excludes at ``-inf``."""
        return mx.where(mx.array(allowed), logits, mx.array(-mx.inf, dtype=logits.dtype))

    def _consume(self, tokens: list[int]) -> None:
        if tokens and not self.matcher.consume_tokens(tokens):
            raise GrammarError(f"the output left its grammar: {_first_line(self.matcher)}")
        self.consumed += len(tokens)

    def _allowed(self, width: int) -> np.ndarray:
        """The tokens the grammar allows next, as a bool vector of the logits' *width*."""
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar cannot go on: {_first_line(self.matcher)}")
        return np.unpackbits(words, bitorder="little")[:width].astype(np.bool_)
