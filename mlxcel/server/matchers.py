"""Grammar matchers, compiled in the HTTP layer's threads before a request reaches the engine.

A grammar is compiled against the vocabulary (``LLMatcher(tokenizer,
grammar)``: tenths of a second for a large schema and a 150k vocabulary).
That runs here, on a thread of its own (:func:`~.native.run_native`), never on
the engine's worker thread, where it would stall every sequence decoding: the
engine receives a ready matcher and only masks with it, and a grammar that
cannot be compiled is a 400 before admission. llguidance drops the GIL while it compiles a matcher,
so the worker runs on meanwhile. llguidance's tokenizer, which does hold the
GIL for its walk of the vocabulary (about a second), is built once at load,
before anything decodes (``engine.grammar.grammar_tokenizer``).

The same tokenizer gives each token's own bytes for chat logprobs (a
byte-level BPE token can be part of a UTF-8 character, which no decoded
text can show). No mlx here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .context import EngineApi
from .native import run_native


class GrammarProblem(ValueError):
    """A grammar the served tokenizer cannot be constrained by; the message says why (one line)."""


async def compile_matchers(grammar: str, copies: int, engine: EngineApi) -> list[Any]:
    """*copies* fresh ``LLMatcher`` for *grammar* (one per sequence: a matcher holds its sequence's state);
    raises :class:`GrammarProblem`."""
    import llguidance

    ll = engine.grammar_tokenizer
    if isinstance(ll, str):  # why there is none
        raise GrammarProblem(ll)

    def build() -> list[Any]:
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarProblem(matcher.get_error().splitlines()[0])
        return [matcher] + [matcher.deep_copy() for _ in range(copies - 1)]

    return await run_native(build, engine)


def token_bytes(ids: Sequence[int], engine: EngineApi) -> list[bytes] | None:
    """Each token's own bytes (a special token's are its text); None without llguidance's tokenizer."""
    ll = engine.grammar_tokenizer
    return None if isinstance(ll, str) else [ll.decode_bytes([t]) for t in ids]
