"""Grammar matchers, compiled in the HTTP layer's threads before a request reaches the engine.

A grammar is compiled against the vocabulary (``LLMatcher(tokenizer,
grammar)``: tenths of a second for a large schema and a 150k vocabulary).
That runs here, on a thread of its own (:func:`~.native.run_native`), never on
the engine's worker thread, where it would stall every sequence decoding: the
engine receives a ready matcher and only masks with it, and a grammar that
cannot be compiled is a 400 before admission. Whatever the schema's bounds
(:mod:`.schema_bounds`) let through, llguidance runs under tighter limits than its
own (:func:`parser_limits`), and a grammar whose first mask costs more than
:data:`FIRST_MASK_SECONDS` of this thread's time is refused: the mask is
computed once per token per sequence on the batch's critical path, so a grammar
that is slow there slows every stream beside it. llguidance drops the GIL while it compiles a matcher,
so the worker runs on meanwhile. llguidance's tokenizer, which does hold the
GIL for its walk of the vocabulary (about a second), is built once at load,
before anything decodes (``engine.grammar.grammar_tokenizer``).

The same tokenizer gives each token's own bytes for chat logprobs (a
byte-level BPE token can be part of a UTF-8 character, which no decoded
text can show). No mlx here.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from .context import EngineApi
from .native import run_native

FIRST_MASK_SECONDS = 0.010
"""The most a grammar's first mask may cost, in the compiling thread's CPU time (not wall time: a loaded machine
does not refuse a cheap grammar), in the better of two compiles when the first is over it. Masks for schemas
within the bounds cost tenths of a millisecond to about two (``benchmarks/grammar_mask.py``)."""


class GrammarProblem(ValueError):
    """A grammar the served tokenizer cannot be constrained by; the message says why (one line)."""


def parser_limits() -> Any:
    """llguidance's limits for a request's grammar: a fifth of its defaults for the lexer's fuel at build, a
    quarter for each mask's (about 4 ms at its stated speeds), a fifth for the lexer's states; and errors that
    name no part of the grammar (they reach logs and clients)."""
    import llguidance

    return llguidance.LLParserLimits(initial_lexer_fuel=200_000, step_lexer_fuel=50_000, max_lexer_states=50_000,
                                     verbose_errors=False)


async def compile_matchers(grammar: str, copies: int, engine: EngineApi) -> list[Any]:
    """*copies* fresh ``LLMatcher`` for *grammar* (one per sequence: a matcher holds its sequence's state);
    raises :class:`GrammarProblem`."""
    import llguidance

    ll = engine.grammar_tokenizer
    if isinstance(ll, str):  # why there is none
        raise GrammarProblem(ll)

    def first_masked() -> tuple[Any, float]:
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0, limits=parser_limits())
        started = time.thread_time()
        matcher.compute_bitmask()  # what the first step will ask for; a pure computation
        return matcher, time.thread_time() - started

    def build() -> list[Any]:
        matcher, spent = first_masked()
        if matcher.is_error():
            raise GrammarProblem(matcher.get_error().splitlines()[0])
        if spent > FIRST_MASK_SECONDS:
            # On a virtual machine a thread's CPU time also counts what the host took from it (``^a{1000}$``'s
            # first mask, about 1 ms, read 15 ms in a loaded test run): a grammar is refused only if a fresh
            # compile's first mask is as slow again.
            matcher, again = first_masked()
            spent = min(spent, again)
        if spent > FIRST_MASK_SECONDS:
            raise GrammarProblem(f"the grammar's first mask took {spent * 1e3:.0f} ms, more than "
                                 f"{FIRST_MASK_SECONDS * 1e3:.0f}: it would slow every stream decoding beside it")
        return [matcher] + [matcher.deep_copy() for _ in range(copies - 1)]

    return await run_native(build, engine)


def token_bytes(ids: Sequence[int], engine: EngineApi) -> list[bytes] | None:
    """Each token's own bytes (a special token's are its text); None without llguidance's tokenizer."""
    ll = engine.grammar_tokenizer
    return None if isinstance(ll, str) else [ll.decode_bytes([t]) for t in ids]
