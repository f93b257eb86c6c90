"""The tokenizer as the HTTP layer uses it: one call at a time, off the event loop, bounded first.

Hugging Face fast tokenizers are not safe to use from several threads at once
(``RuntimeError: Already borrowed``, huggingface/tokenizers#537), and trio
would otherwise run up to 40 handlers' tokenizations in parallel threads. So
every call goes through one :class:`trio.CapacityLimiter`; the event loop
never calls the tokenizer itself. The worker's detokenizer, on the MLX thread,
is outside this gate (the engine owns it).

Before a long prompt is tokenized, :meth:`Tokens.min_tokens` gives a lower
bound on its token count from its length alone, so that a prompt that cannot
fit the context is refused without building a token list of a million ids.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import trio

T = TypeVar("T")

_COMPOSING = frozenset({"NFC", "NFKC"})
"""Normalizers that can merge characters: NFC turns at most four code points into one
(a Greek vowel with three combining marks, U+1F8F), NFKC likewise."""
_LENGTH_KEEPING = frozenset({"NFD", "NFKD", "Lowercase", "Prepend"})
_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation",
                             "Sequence"})
"""Pre-tokenizers that never drop text (Split and Punctuation unless their behaviour is Removed)."""


def _shrink_factor(spec: dict[str, Any] | None) -> int | None:
    """How many input characters one normalized character may stand for; None if unbounded."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", []):
            inner = _shrink_factor(part)
            if inner is None:
                return None
            factor *= inner
        return factor
    if kind in _COMPOSING:
        return 4
    if kind in _LENGTH_KEEPING:
        return 1
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}).get("String"), spec.get("content", "")
        if isinstance(pattern, str) and pattern and content:
            return math.ceil(len(pattern) / len(content))
    return None  # a regex replace, Strip, BERT's cleaning...: may delete text


def _keeps_text(spec: dict[str, Any] | None) -> bool:
    """Whether a pre-tokenizer keeps every character (so every character lands in some token)."""
    if spec is None:
        return True
    kind = spec.get("type")
    if kind not in _PRE_TOKENIZERS or spec.get("behavior") == "Removed":
        return False
    return all(_keeps_text(part) for part in spec.get("pretokenizers", []))


def chars_per_token(tokenizer: Any) -> int | None:
    """The most prompt characters one token can stand for, or None if that has no bound.

    A bound exists for a BPE tokenizer whose normalizer and pre-tokenizer never
    delete text, whose unknown characters are not fused into one token, and
    whose added tokens do not swallow the whitespace around them. Then every
    token covers at most as many characters as its longest vocabulary entry
    (byte-level entries have one character per byte, so this also holds for
    multi-byte characters), times what normalization can merge into one.
    """
    try:
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
        entries = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    except Exception:  # not a Hugging Face fast tokenizer: no bound, tokenize in full
        return None
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        return None
    if model.get("unk_token") is not None and model.get("fuse_unk") and not model.get("byte_fallback"):
        return None
    if any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []):
        return None
    factor = _shrink_factor(spec.get("normalizer"))
    if factor is None or not _keeps_text(spec.get("pre_tokenizer")):
        return None
    longest = max((len(e) for e in entries if isinstance(e, str)), default=0)
    return longest * factor if longest else None


class Tokens:
    """Every tokenizer call from the HTTP layer, serialised; the length bound, computed once."""

    def __init__(self) -> None:
        self._limiter = trio.CapacityLimiter(1)
        self._bound: tuple[int | None] | None = None  # (chars_per_token,) once computed
        self._pieces: dict[int, str] = {}

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread, never beside another tokenizer call from here."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def min_tokens(self, tokenizer: Any, text: str) -> int:
        """A lower bound on ``len(tokenizer.encode(text))``, from the length of *text* alone (0 if none)."""
        if self._bound is None:
            self._bound = (await self.run(chars_per_token, tokenizer),)
        (per_token,) = self._bound
        return math.ceil(len(text) / per_token) if per_token else 0

    async def pieces(self, tokenizer: Any, ids: Sequence[int]) -> list[str]:
        """Each token's own text (for logprobs), decoded once per id and remembered."""
        missing = sorted({t for t in ids if t not in self._pieces})
        if missing:
            decoded = await self.run(lambda: [tokenizer.decode([t]) for t in missing])
            self._pieces.update(zip(missing, decoded, strict=True))
        return [self._pieces[t] for t in ids]
