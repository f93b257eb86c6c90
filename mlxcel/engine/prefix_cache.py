"""The prefix cache: prompt caches kept for later prompts, in memory and on disk, bounded in bytes.

A new prompt resumes from the kept cache that serves the most of it (see
:func:`usable`), and prefills only the rest. A plain KV cache can be trimmed
back to any shorter prefix, so the cache a finished sequence leaves (prompt
and generated tokens) serves every later prompt that shares part of it, as
mlx-lm's ``LRUPromptCache`` does. Recurrent state (Qwen 3.5's gated delta),
convolution state (Inkling's) and a sliding window that has wrapped (Gemma 4's
ring) cannot be rewound: such an entry serves only prompts it is a prefix of,
and what a sequence leaves never is one for the next turn of a chat (the
template renders the reply anew). So for those a prefill also keeps
*snapshots* (:meth:`PrefixCache.snapshot`): its cache at positions a later
prompt is likely to share (the request's ``checkpoints`` and the end of its
prompt). Snapshots share their arrays with the live cache (MLX arrays are
values: the live cache's next update writes a new buffer), so taking one
costs no copy up front.

Memory holds entries least recently used first, within ``--prompt-cache-bytes``;
what it evicts, and what it holds when the server stops, goes to the disk tier
(:mod:`.prompt_disk`) when there is one, which a later prompt, or a later
server, reads back. Our own small LRU rather than mlx-lm's: it says what it
evicts, which the disk tier needs. Worker thread only.
"""

from __future__ import annotations

import copy
import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeVar

import numpy as np

from ..observability import CacheStats

logger = logging.getLogger(__name__)


class Disk(Protocol):
    """What the prefix cache asks of its disk tier (:class:`.prompt_disk.DiskTier`, which knows this module,
    not the other way round)."""

    max_bytes: int

    @property
    def entries(self) -> int: ...

    @property
    def bytes(self) -> int: ...

    def fetch(self, prompt: np.ndarray, better_than: int) -> tuple[np.ndarray, list[Any], Any] | None: ...

    def check_ahead(self, prompt: np.ndarray, better_than: int) -> Future[Any] | None: ...

    def save(self, tokens: np.ndarray, cache: list[Any], drafter: tuple[int, Any] | None = None) -> None: ...

    def close(self) -> None: ...


def rewindable(cache: list[Any]) -> bool:
    """Whether *cache* can be trimmed back to any shorter prefix, now and however long it grows.

    A ring (mlx-lm's ``RotatingKVCache``) can be trimmed only until it wraps, so it counts as not rewindable.
    """
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    return all(isinstance(layer, KVCache | QuantizedKVCache) for layer in cache)


def usable(held: np.ndarray, rewinds: bool, tokens: np.ndarray) -> int:
    """How many of *tokens* a cache holding exactly *held* can stand for (0: none).

    One that is a prefix of the prompt stands for all it holds. Otherwise only a
    rewindable one serves, trimmed back to the common prefix, and never to the
    whole prompt: the last prompt token is always fed, for its logits.
    """
    n = min(len(held), len(tokens))
    differ = np.flatnonzero(held[:n] != tokens[:n])
    common = int(differ[0]) if differ.size else n
    if common == len(held) < len(tokens):
        return common
    return min(common, len(tokens) - 1) if rewinds else 0


class _Kept(Protocol):
    tokens: np.ndarray
    rewinds: bool


K = TypeVar("K", bound=_Kept)


def best_for(kept: Iterable[K], prompt: np.ndarray, better_than: int = 0) -> tuple[K | None, int]:
    """Of *kept* (entries in memory or on disk), the one standing for the most of *prompt*, if more than
    *better_than* tokens, and how much it stands for (else *better_than*)."""
    best, length = None, better_than
    for entry in kept:
        n = usable(entry.tokens, entry.rewinds, prompt)
        if n > length:
            best, length = entry, n
    return best, length


@dataclass
class Entry:
    key: tuple[int, ...]
    tokens: np.ndarray
    cache: list[Any]
    rewinds: bool
    nbytes: int
    drafter: tuple[int, Any] | None = None
    """The MTP drafter's state beside a snapshot (on disk too), and the token after *tokens* it has read:
    it serves a prompt that goes on with that token."""


class Resumed(NamedTuple):
    """What :meth:`PrefixCache.fetch` found for a prompt."""

    cache: list[Any] | None
    rest: list[int]
    """The prompt tokens still to prefill (never empty)."""
    drafter: Any = None
    """The drafter's state kept with *cache*, where it serves this prompt (see ``SequenceDrafter.restore``)."""


class PrefixCache:
    """Kept prompt caches, in memory within *max_bytes* (and *entries*, if given) and on *disk*, if given."""

    def __init__(self, entries: int | None, model_type: str = "", max_bytes: int = 1 << 30,
                 disk: Disk | None = None) -> None:
        self._model_type = model_type
        self._held: OrderedDict[tuple[int, ...], Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._entries, self._max_bytes = entries, max_bytes
        self.disk = disk
        self._lookups = self._hits = self._prompt_tokens = self._reused = 0
        self._snapshots = self._evictions = self._disk_hits = 0

    @property
    def off(self) -> bool:
        return self._entries == 0

    def fetch(self, tokens: list[int]) -> Resumed:
        """A cache standing for a prefix of *tokens*, and the tokens still to prefill."""
        from ..families import family

        self._lookups += 1
        self._prompt_tokens += len(tokens)
        if self.off or not tokens:
            return Resumed(None, list(tokens))
        prompt = np.asarray(tokens, dtype=np.int64)
        best, length = best_for(self._held.values(), prompt)
        if self.disk is not None:
            loaded = self.disk.fetch(prompt, better_than=length)
            if loaded is not None:
                held, cache, drafter = loaded
                best = self._insert(held.tolist(), cache)
                if best is not None:
                    best.drafter = drafter
                self._disk_hits += 1
                length = usable(held, best.rewinds, prompt) if best is not None else 0
        if best is None or length == 0:
            return Resumed(None, list(tokens))
        self._held.move_to_end(best.key)
        cache = copy.deepcopy(best.cache)
        if length < len(best.tokens):
            from mlx_lm.models.cache import trim_prompt_cache

            trim_prompt_cache(cache, len(best.tokens) - length)
        drafter = best.drafter[1] if best.drafter is not None and length == len(best.tokens) and \
            best.drafter[0] == tokens[length] else None
        self._hits += 1
        self._reused += length
        # A batch hands back mlx-lm's own cache classes; the family's are what its sequences run on.
        return Resumed(family(self._model_type).adopt_cache(cache), list(tokens[length:]), drafter)

    def read_ahead(self, tokens: list[int]) -> Future[Any] | None:
        """Where an entry on disk would serve more of *tokens* than memory does, its files read and checked on
        the disk tier's reader thread, so that :meth:`fetch` loads them without a check in the worker's turn:
        the read; None when there is nothing to read."""
        if self.off or not tokens or self.disk is None:
            return None
        prompt = np.asarray(tokens, dtype=np.int64)
        return self.disk.check_ahead(prompt, better_than=best_for(self._held.values(), prompt)[1])

    def store(self, tokens: list[int], cache: list[Any]) -> None:
        """Keep a finished sequence's cache, which holds exactly *tokens*."""
        if not self.off and tokens:
            self._insert(tokens, cache)

    def snapshot(self, tokens: list[int], cache: list[Any], drafter: tuple[int, Any] | None = None) -> bool:
        """Keep a copy of a live sequence's cache, which holds exactly *tokens*, if only a copy could serve
        their prefix later (the cache cannot be rewound). Whether one was kept.

        *drafter*: the token after *tokens* and the sequence's MTP drafter, which has read it (the target's
        hidden state at each position goes with the token after it); its state is kept too, so that a prompt
        resumed here drafts from its first step, as it would have after a prefill.
        """
        if self.off or not tokens or rewindable(cache):
            return False
        entry = self._insert(tokens, copy.deepcopy(cache))
        if entry is not None and drafter is not None:
            entry.drafter = (drafter[0], drafter[1].snapshot())
        self._snapshots += 1
        return True

    def _insert(self, tokens: Sequence[int], cache: list[Any]) -> Entry | None:
        """Hold *cache* for *tokens* (most recently used), then evict within the bounds; the entry, if it
        stayed."""
        key = tuple(tokens)
        old = self._held.pop(key, None)
        if old is not None:
            self._bytes -= old.nbytes
        entry = Entry(key, np.asarray(key, dtype=np.int64), cache, rewindable(cache), sum(c.nbytes for c in cache))
        if entry.rewinds:  # a rewindable entry stands for every rewindable one it extends: they only take room
            for other in [k for k, e in self._held.items() if e.rewinds and len(k) < len(key)
                          and np.array_equal(entry.tokens[:len(k)], e.tokens)]:
                self._bytes -= self._held.pop(other).nbytes
        self._held[key] = entry
        self._bytes += entry.nbytes
        while self._held and (self._bytes > self._max_bytes or
                              (self._entries is not None and len(self._held) > self._entries)):
            evicted = self._held.pop(self._victim())
            self._bytes -= evicted.nbytes
            self._evictions += 1
            if self.disk is not None:
                self.disk.save(evicted.tokens, evicted.cache, evicted.drafter)
        return self._held.get(key)

    def _victim(self) -> tuple[int, ...]:
        """The entry to evict: the least recently used that is not a shared head, else the least recently
        used.

        A shared head (a system prompt and tool schemas every session of an agent sends) is the prefix of
        held entries that diverge after it: sessions each resume from their own deepest entry and so use
        the head only when a new one starts, which plain LRU would take for disuse while one long session
        fills memory."""
        held = [entry.tokens for entry in self._held.values()]
        for key, entry in self._held.items():
            if not _branches_at(entry.tokens, held):
                return key
        return next(iter(self._held))

    def persist(self) -> None:
        """Write what memory holds to the disk tier, most recently used first (the server is stopping)."""
        if self.disk is None:
            return
        for entry in reversed(self._held.values()):
            self.disk.save(entry.tokens, entry.cache, entry.drafter)

    def close(self) -> None:
        """Let go of the disk tier's directory (after :meth:`persist`: the server is stopping)."""
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> CacheStats:
        disk = self.disk
        return CacheStats(entries=len(self._held), bytes=self._bytes, max_entries=self._entries,
                          max_bytes=self._max_bytes, lookups=self._lookups, hits=self._hits,
                          prompt_tokens=self._prompt_tokens, reused_tokens=self._reused,
                          snapshots=self._snapshots, evictions=self._evictions, disk_hits=self._disk_hits,
                          disk_entries=disk.entries if disk else 0, disk_bytes=disk.bytes if disk else 0,
                          max_disk_bytes=disk.max_bytes if disk else 0)


def _branches_at(head: np.ndarray, held: list[np.ndarray]) -> bool:
    """Whether entries of *held* extend *head* and then part: it is a prefix shared by diverging prompts."""
    n = len(head)
    extending = [tokens for tokens in held if len(tokens) > n and np.array_equal(tokens[:n], head)]
    if len(extending) < 2:
        return False
    longest = max(extending, key=len)  # they part unless every one is a prefix of the longest
    return any(not np.array_equal(longest[:len(tokens)], tokens) for tokens in extending)
