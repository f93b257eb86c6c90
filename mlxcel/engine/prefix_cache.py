"""The prefix cache: mlx-lm's LRU prompt cache, with the statistics ``/v1/cache/stats`` shows."""

from __future__ import annotations

from typing import Any

from ..observability import CacheStats


class PrefixCache:
    """mlx-lm's LRU prompt cache, with the statistics ``/v1/cache/stats`` shows."""

    def __init__(self, key: str, entries: int, model_type: str = "", max_bytes: int = 1 << 30) -> None:
        from mlx_lm.models.cache import LRUPromptCache

        self._key = key
        self._model_type = model_type
        self._lru = LRUPromptCache(max_size=entries, max_bytes=max_bytes)
        self._entries, self._max_bytes = entries, max_bytes
        self._lookups = self._hits = self._prompt_tokens = self._reused = 0

    def fetch(self, tokens: list[int]) -> tuple[list[Any] | None, list[int]]:
        """A cache covering a prefix of *tokens*, and the tokens still to prefill (never empty)."""
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        from ..families import family

        cache, rest = self._lru.fetch_nearest_cache(self._key, tokens)
        if cache is not None:
            # A batch hands back mlx-lm's own cache classes; the family's are what its sequences run on.
            cache = family(self._model_type).adopt_cache(cache)
        if cache is not None and not rest:
            # An exact hit still needs the last token's logits: step back one.
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                rest = tokens[-1:]
            else:
                cache, rest = None, tokens
        self._lookups += 1
        self._prompt_tokens += len(tokens)
        if cache is not None:
            self._hits += 1
            self._reused += len(tokens) - len(rest)
        return cache, list(rest)

    def store(self, tokens: list[int], cache: list[Any]) -> None:
        self._lru.insert_cache(self._key, list(tokens), cache)

    def stats(self) -> CacheStats:
        return CacheStats(entries=len(self._lru), bytes=self._lru.nbytes, max_entries=self._entries,
                          max_bytes=self._max_bytes,
                          lookups=self._lookups, hits=self._hits, prompt_tokens=self._prompt_tokens,
                          reused_tokens=self._reused)
