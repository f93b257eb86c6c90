"""The per-sequence state machine of a head that keeps a KV cache of its own (Qwen 3.5's, GLM-4.7-Flash's)."""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx


class OwnCacheSequence:
    """One sequence's state of a head with a KV cache of its own: the cache, the (hidden, token)
    pairs it has not read yet, and the head's output at the last position it read.

    Any such head (Qwen's, GLM's) drives it through *drafter*'s ``head(embeddings, hidden, cache)``
    (the output fed back as the next hidden), ``head.make_cache()``, ``embed`` and ``lm_head``.
    """

    def __init__(self, drafter: Any) -> None:
        self._drafter = drafter
        self._cache = drafter.head.make_cache()
        self._pending: list[tuple[mx.array, mx.array]] = []
        self._last: mx.array | None = None

    @property
    def ready(self) -> bool:
        return self._last is not None or bool(self._pending)

    def catch_up(self, hidden: mx.array, tokens: mx.array) -> None:
        # Deferred: pairs from single steps are read in one head forward, at the next draft.
        self._pending.append((hidden, tokens))

    def settle(self) -> list[mx.array]:
        if self._pending:
            d = self._drafter
            hidden = mx.concatenate([h for h, _ in self._pending], axis=1)
            tokens = mx.concatenate([t for _, t in self._pending], axis=1)
            self._pending = []
            self._last = d.head(d.embed(tokens), hidden, self._cache)[:, -1:, :]
        return [] if self._last is None else [self._last]

    def draft(self, count: int) -> mx.array:
        d = self._drafter
        self.settle()
        assert self._last is not None
        out = self._last
        drafts = [mx.argmax(d.lm_head(out), axis=-1)]
        for _ in range(count - 1):
            out = d.head(d.embed(drafts[-1]), out, self._cache)
            drafts.append(mx.argmax(d.lm_head(out), axis=-1))
        return mx.concatenate(drafts, axis=1)

    def accept(self, hidden: mx.array, tokens: mx.array, drafted: int) -> None:
        # The chained drafts after the first went through the head's cache: take them out.
        if drafted > 1:
            for c in self._cache:
                c.trim(drafted - 1)
        self.catch_up(hidden, tokens)

    def snapshot(self) -> Any:
        self.settle()
        return copy.deepcopy((self._cache, self._last))

    def restore(self, state: Any) -> None:
        self._cache, self._last = copy.deepcopy(state)
        self._pending = []
