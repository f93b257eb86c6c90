"""The prefix cache on its own: which kept cache serves a prompt, its byte bound, and its snapshots."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mlxcel.engine.prefix_cache import PrefixCache, usable


def _a(*tokens: int) -> np.ndarray:
    return np.asarray(tokens, dtype=np.int64)


@pytest.mark.parametrize(("held", "rewinds", "prompt", "serves"), [
    ((1, 2, 3), False, (1, 2, 3, 4), 3),  # a prefix: all of it, as it is
    ((1, 2, 3), True, (1, 2, 3, 4), 3),
    ((1, 2, 3), False, (1, 2, 3), 0),  # the whole prompt: the last token must be fed, and it cannot rewind
    ((1, 2, 3), True, (1, 2, 3), 2),  # ... so a rewindable one steps back one
    ((1, 2, 3, 4, 5), True, (1, 2, 3, 9), 3),  # longer, diverging: trimmed to the common prefix
    ((1, 2, 3, 4, 5), False, (1, 2, 3, 9), 0),
    ((1, 2, 3, 4, 5), True, (1, 2, 3), 2),
    ((7, 2, 3), True, (1, 2, 3), 0),
])
def test_which_cache_serves_how_much_of_a_prompt(held: tuple[int, ...], rewinds: bool, prompt: tuple[int, ...],
                                                 serves: int) -> None:
    assert usable(_a(*held), rewinds, _a(*prompt)) == serves


def _kv(tokens: int) -> list[object]:
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    layer = KVCache()
    layer.update_and_fetch(mx.zeros((1, 2, tokens, 8)), mx.zeros((1, 2, tokens, 8)))
    return [layer]


def _ring(tokens: int) -> list[object]:
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    layer = RotatingKVCache(max_size=4)
    for _ in range(tokens):
        layer.update_and_fetch(mx.zeros((1, 2, 1, 8)), mx.zeros((1, 2, 1, 8)))
    return [layer]


def test_memory_is_bounded_in_bytes_least_recently_used_first() -> None:
    one = sum(c.nbytes for c in _kv(10))  # type: ignore[attr-defined]
    cache = PrefixCache(None, max_bytes=2 * one)
    for first in (1, 2, 3):
        cache.store([first, *range(100, 109)], _kv(10))
    assert cache.fetch([1, *range(100, 109), 5])[0] is None  # the oldest went
    assert cache.fetch([2, *range(100, 109), 5])[1] == [5]
    cache.store([4, *range(100, 109)], _kv(10))  # evicts 3, not 2: 2 was used since
    assert cache.fetch([3, *range(100, 109), 5])[0] is None
    assert cache.fetch([2, *range(100, 109), 5])[1] == [5]
    stats = cache.stats()
    assert (stats.entries, stats.evictions, stats.hits, stats.reused_tokens) == (2, 2, 2, 20)


def test_snapshots_only_of_caches_that_cannot_rewind() -> None:
    import mlx.core as mx

    cache = PrefixCache(None)
    assert not cache.snapshot([1, 2, 3], _kv(3))  # a KV cache serves its prefixes itself
    ring = _ring(6)  # wrapped: the positions before the last four are gone
    assert cache.snapshot(list(range(6)), ring)
    ring[0].update_and_fetch(mx.ones((1, 2, 1, 8)), mx.ones((1, 2, 1, 8)))  # type: ignore[attr-defined]
    got, rest, _ = cache.fetch([*range(6), 9, 9])  # the live cache went on; the snapshot kept its position
    assert rest == [9, 9] and got is not None and got[0].offset == 6
    assert mx.all(got[0].keys == 0).item()  # none of the live cache's later writes
    assert cache.stats().snapshots == 1
    assert PrefixCache(0).fetch([1, 2])[0] is None  # size 0: off


def test_a_head_that_sessions_share_outlives_one_session_filling_memory() -> None:
    """Two sessions resumed from one head; then one long session fills memory. LRU alone would evict the head
    (used only when a session starts); it goes last, after the sessions' own older entries."""
    one = sum(c.nbytes for c in _ring(6))  # type: ignore[attr-defined]
    cache = PrefixCache(None, max_bytes=4 * one)
    head = list(range(10, 16))
    cache.snapshot(head, _ring(6))
    for session in (1, 2):
        cache.snapshot([*head, session, 0], _ring(6))
    for turn in range(1, 4):  # session 1 goes on alone: each turn a deeper snapshot
        cache.snapshot([*head, 1, 0, *range(turn)], _ring(6))
    # The two least recently used entries that are not the head went: session 1's first and session 2's.
    assert cache.stats().evictions == 2
    got, rest, _ = cache.fetch([*head, 3, 3])  # a third session starts: the head serves it
    assert got is not None and rest == [3, 3]
    assert cache.fetch([*head, 2, 0, 9])[1] == [2, 0, 9]  # and session 2, whose own entry went
    assert cache.fetch([*head, 1, 0, 0, 1, 2, 7])[1] == [7]  # session 1 keeps its deepest


def test_a_drafters_state_goes_to_disk_with_its_snapshot_and_comes_back_byte_for_byte(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A drafter's snapshot as the own-cache heads make it (their KV caches, the last hidden state read, a
    count), through the disk tier and back; of another drafter, or damaged, it is no state, never an error."""
    import mlx.core as mx
    from mlx_lm.models import cache as mlx_cache

    from mlxcel.engine.prompt_disk import DiskTier

    root = tmp_path
    classes = {name: c for name, c in vars(mlx_cache).items() if isinstance(c, type)}
    layers = _ring(6)
    head = _kv(5)
    state = ([head[0]], mx.arange(12, dtype=mx.float32).reshape(1, 1, 12), 3)
    tokens = np.arange(6, dtype=np.int64)

    opened: list[DiskTier] = []

    def tier(drafter: str) -> DiskTier:
        """A new tier on the directory, as a restarted server opens it: the last one let go of it first."""
        if opened:
            opened.pop().close()
        opened.append(DiskTier(root, 1 << 30, "model", classes, layers, drafter))
        return opened[-1]

    tier("head|qNone").save(tokens, layers, (42, state))
    _, _, back = tier("head|qNone").fetch(np.arange(8, dtype=np.int64), better_than=0)  # type: ignore[misc]
    token, (caches, hidden, count) = back
    assert (token, count, type(caches[0])) == (42, 3, mlx_cache.KVCache)
    assert caches[0].offset == 5 and mx.array_equal(caches[0].keys[..., :5, :], head[0].keys[..., :5, :]).item()
    assert mx.array_equal(hidden, state[1]).item()
    assert tier("other-head|q4").fetch(np.arange(8, dtype=np.int64), better_than=0)[2] is None  # type: ignore[index]
    (drafter_file,) = root.glob("*.drafter.safetensors")
    drafter_file.write_bytes(b"not a safetensors file")
    with caplog.at_level("WARNING"):
        got = tier("head|qNone").fetch(np.arange(8, dtype=np.int64), better_than=0)
    assert got is not None and got[2] is None  # the snapshot itself still serves
    assert "ignoring the drafter's state" in caplog.text
