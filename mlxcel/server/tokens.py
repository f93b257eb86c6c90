"""The tokenizer as the HTTP layer uses it: one call at a time, off the event loop, bounded first.

Hugging Face fast tokenizers are not safe to use from several threads at once
(``RuntimeError: Already borrowed``, huggingface/tokenizers#537), and trio
would otherwise run up to 40 handlers' tokenizations in parallel threads. So
every call goes through a :class:`trio.CapacityLimiter` of one; the event loop
never calls the tokenizer itself. The worker's detokenizer, on the MLX thread,
is outside this gate (the engine owns it).

Long texts have a lane of their own (see :class:`Tokens`). Before a long
prompt is tokenized, :meth:`Tokens.min_tokens` gives a lower bound on its
token count from its length alone, so that a prompt that cannot fit the
context is refused without building a token list of a million ids.
"""

from __future__ import annotations

import copy
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


LONG_TEXT = 65_536
"""Characters from which a text is encoded in the long lane, by its own copy of the tokenizer."""


REMEMBERED = 16
"""Texts whose tokens :meth:`Tokens.encode_remembered` keeps."""


class Tokens:
    """Every tokenizer call from the HTTP layer, one at a time per lane; the length bound, computed once.

    Two lanes, so that a long prompt (a 4 MiB one takes seconds to encode)
    does not hold up every other request's tokenizing: texts of
    :data:`LONG_TEXT` characters or more are encoded one at a time by a
    private copy of the tokenizer, made when the first one comes; everything
    else goes through the shared tokenizer, one call at a time. No tokenizer
    object is ever used by two threads at once.
    """

    def __init__(self) -> None:
        self._limiter = trio.CapacityLimiter(1)
        self._long_limiter = trio.CapacityLimiter(1)
        self._long_copy: Any = None
        self._bound: tuple[int | None] | None = None  # (chars_per_token,) once computed
        self._pieces: dict[int, str] = {}
        self._remembered: dict[str, list[int]] = {}  # oldest first

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread, never beside another call on the shared tokenizer."""
        return await trio.to_thread.run_sync(fn, *args, limiter=self._limiter)

    async def encode(self, tokenizer: Any, text: str, **kwargs: Any) -> list[int]:
        """``tokenizer.encode(text, **kwargs)``, in the lane its length calls for."""
        if len(text) < LONG_TEXT:
            return list(await self.run(lambda: tokenizer.encode(text, **kwargs)))

        def encode_long() -> list[int]:
            if self._long_copy is None:
                self._long_copy = copy.deepcopy(tokenizer)
            return list(self._long_copy.encode(text, **kwargs))

        return await trio.to_thread.run_sync(encode_long, limiter=self._long_limiter)

    async def encode_remembered(self, tokenizer: Any, text: str, **kwargs: Any) -> list[int]:
        """:meth:`encode`, remembered for the last :data:`REMEMBERED` texts: for a text every request of a
        conversation repeats (a chat's system prompt), encoded once; a text is always encoded with the same
        *kwargs* by its one caller."""
        ids = self._remembered.pop(text, None)
        if ids is None:
            ids = await self.encode(tokenizer, text, **kwargs)
        self._remembered[text] = ids
        while len(self._remembered) > REMEMBERED:
            del self._remembered[next(iter(self._remembered))]
        return ids

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
