"""llguidance's side of the served tokenizer: grammar matchers compiled before a request reaches the engine.

A grammar is compiled against the vocabulary (``LLMatcher(tokenizer,
grammar)``: tenths of a second for a large schema and a 150k vocabulary),
and llguidance's tokenizer itself walks the whole vocabulary once (about a
second). Both run here, in trio's thread pool, never on the engine's worker
thread, where they would stall every sequence decoding: the engine receives
a ready matcher and only masks with it. A grammar that cannot be compiled is
therefore a 400 before admission. llguidance drops the GIL while it compiles.

The same tokenizer gives each token's own bytes for chat logprobs (a
byte-level BPE token can be part of a UTF-8 character, which no decoded
text can show). No mlx here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio

from .tokens import Tokens


class GrammarProblem(ValueError):
    """A grammar the served tokenizer cannot be constrained by; the message says why (one line)."""


def _backend(tokenizer: Any) -> Any:
    """The Hugging Face tokenizer behind mlx-lm's wrapper."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


class Matchers:
    """llguidance's tokenizer, built on first use off the event loop and the worker, and the matchers compiled
    with it. One per server: the served tokenizer does not change."""

    def __init__(self) -> None:
        self._lock = trio.Lock()
        self._tokenizer: Any = None

    async def tokenizer(self, tokenizer: Any, vocab_size: int, tokens: Tokens) -> Any:
        """llguidance's ``LLTokenizer`` for the served *tokenizer* (mlx-lm's wrapper), logits *vocab_size* wide.

        Raises :class:`GrammarProblem` for a tokenizer that is not a Hugging Face fast (Rust) one:
        llguidance reads the vocabulary from the Rust tokenizer's JSON.
        """
        hf = _backend(tokenizer)
        if not hasattr(hf, "backend_tokenizer"):
            raise GrammarProblem(f"constrained decoding needs a Hugging Face fast tokenizer, and this model's "
                                 f"is {type(hf).__name__}")
        async with self._lock:  # concurrent first requests build it once
            if self._tokenizer is None:
                import llguidance

                def spec() -> str:
                    backend = hf.backend_tokenizer
                    return str(backend.to_str())

                # The serialization reads the shared tokenizer (the tokenizer lane); the vocabulary walk
                # reads only the JSON, so it runs beside other requests' tokenizing.
                text = await tokens.run(spec)
                eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
                def build() -> Any:
                    try:
                        return llguidance.LLTokenizer(text, n_vocab=vocab_size, eos_token=eos)
                    except ValueError as exc:  # a tokenizer.json llguidance cannot make a token table of
                        raise GrammarProblem(f"llguidance cannot read this model's tokenizer: {exc}") from exc

                self._tokenizer = await trio.to_thread.run_sync(build)
            return self._tokenizer

    async def compile(self, grammar: str, copies: int, tokenizer: Any, vocab_size: int,
                      tokens: Tokens) -> list[Any]:
        """*copies* fresh ``LLMatcher`` for *grammar* (one per sequence: a matcher holds its sequence's
        state); raises :class:`GrammarProblem`."""
        import llguidance

        ll = await self.tokenizer(tokenizer, vocab_size, tokens)

        def build() -> list[Any]:
            matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
            if matcher.is_error():
                raise GrammarProblem(matcher.get_error().splitlines()[0])
            return [matcher] + [matcher.deep_copy() for _ in range(copies - 1)]

        return await trio.to_thread.run_sync(build)

    async def token_bytes(self, ids: Sequence[int], tokenizer: Any, vocab_size: int,
                          tokens: Tokens) -> list[bytes] | None:
        """Each token's own bytes (a special token's are its text); None for a tokenizer llguidance cannot read."""
        try:
            ll = await self.tokenizer(tokenizer, vocab_size, tokens)
        except GrammarProblem:
            return None
        return [ll.decode_bytes([t]) for t in ids]
