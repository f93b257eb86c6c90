"""The per-sequence state machine of a head that keeps a KV cache of its own (Qwen 3.5's, GLM-4.7-Flash's)."""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx

from ..batch_rollback import rollback_kv_rows

#: A batch's drafter reads at most this many queued positions a row in one head forward; a row still
#: prefilling reads its prompt in pieces of this many as they arrive, alone, so what it queues stays below it.
SETTLE_CHUNK = 512


def _chain(drafter: Any, last: mx.array, cache: list[Any], count: int) -> mx.array:
    """*count* greedy drafts from the head's output *last* (rows, 1, H), each fed back through the head."""
    out = last
    drafts = [mx.argmax(drafter.lm_head(out), axis=-1)]
    for _ in range(count - 1):
        out = drafter.head(drafter.embed(drafts[-1]), out, cache)
        drafts.append(mx.argmax(drafter.lm_head(out), axis=-1))
    return mx.concatenate(drafts, axis=1)


class OwnCacheSequence:
    """One sequence's state of a head with a KV cache of its own: the cache, the (hidden, token)
    pairs it has not read yet, and the head's output at the last position it read.

    Any such head (Qwen's, GLM's) drives it through *drafter*'s ``head(embeddings, hidden, cache)``
    (the output fed back as the next hidden), ``head.make_cache()``, ``embed`` and ``lm_head``; and, where the
    head has it, ``head.remember(embeddings, hidden, cache)``, which writes positions into the cache without
    their outputs: a catch-up runs the head whole for its last position only.
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
            remember = getattr(d.head, "remember", None)
            if remember is not None and tokens.shape[1] > 1:  # only the last position's output is read
                remember(d.embed(tokens[:, :-1]), hidden[:, :-1], self._cache)
                hidden, tokens = hidden[:, -1:], tokens[:, -1:]
            self._last = d.head(d.embed(tokens), hidden, self._cache)[:, -1:, :]
        return [] if self._last is None else [self._last]

    def draft(self, count: int) -> mx.array:
        self.settle()
        assert self._last is not None
        return _chain(self._drafter, self._last, self._cache, count)

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


class OwnCacheBatch:
    """The rows of a continuous batch drafting together with a head that keeps a KV cache of its own.

    The rows' head caches are merged as mlx-lm merges a batch's (``BatchKVCache``:
    left-padded, one shared index), in the order of the batch's rows, and merged
    again only when the rows change. Each row's unread (hidden, token) pairs are
    read in one head forward for all rows, right-padded to the longest as mlx-lm
    pads a batch of prompts; then K - 1 chained steps draft for every row at
    once. A row joins with the state of the drafter it ran with alone
    (:class:`OwnCacheSequence`), or none.
    """

    def __init__(self, drafter: Any) -> None:
        self._drafter = drafter
        self._uids: list[int] = []
        self._cache: list[Any] = []
        self._last: mx.array | None = None
        """(B, 1, H): each row's head output at the last position it read (zeros where none yet)."""
        self._pending: dict[int, list[tuple[mx.array, mx.array]]] = {}
        self._joining: dict[int, OwnCacheSequence] = {}
        self._read: set[int] = set()
        """Rows whose last output is a real one (they have read a target hidden state)."""

    def join(self, uid: int, sequence: OwnCacheSequence | None) -> None:
        sequence = sequence if sequence is not None else OwnCacheSequence(self._drafter)
        self._joining[uid] = sequence
        self._pending[uid] = list(sequence._pending)
        sequence._pending = []
        if sequence._last is not None:
            self._read.add(uid)

    def leave(self, uid: int) -> None:
        self._joining.pop(uid, None)
        self._pending.pop(uid, None)
        self._read.discard(uid)

    def ready(self, uid: int) -> bool:
        """Whether row *uid* has read, or can read, a target hidden state to draft from."""
        return uid in self._read or bool(self._pending.get(uid))

    def pending(self, uid: int) -> int:
        return sum(t.shape[1] for _, t in self._pending.get(uid, ()))

    def catch_up(self, uid: int, hidden: mx.array, tokens: mx.array) -> None:
        """Row *uid*'s target hidden states (1, S, H) with the tokens after them (1, S), read at the next draft;
        a row that has not drafted in the batch yet (its prompt still prefilling) reads each whole
        :data:`SETTLE_CHUNK` of them now, into the state it joined with: a long prompt is read as it arrives,
        every position of it (as a lone sequence's head reads it), and never waits whole in the queue."""
        queue = self._pending.get(uid)
        if queue is None:
            return
        queue.append((hidden, tokens))
        sequence = self._joining.get(uid)
        if sequence is None or self.pending(uid) < SETTLE_CHUNK:
            return
        hidden = mx.concatenate([h for h, _ in queue], axis=1)
        tokens = mx.concatenate([t for _, t in queue], axis=1)
        whole = tokens.shape[1] // SETTLE_CHUNK * SETTLE_CHUNK
        for start in range(0, whole, SETTLE_CHUNK):
            sequence.catch_up(hidden[:, start:start + SETTLE_CHUNK], tokens[:, start:start + SETTLE_CHUNK])
            mx.async_eval(sequence.settle())  # the chunk's hidden states freed once read
        self._read.add(uid)
        queue[:] = [(hidden[:, whole:], tokens[:, whole:])] if whole < tokens.shape[1] else []

    def draft(self, uids: list[int], count: int, cache: list[Any]) -> mx.array:
        """*count* greedy drafts for each row of *uids* (the batch's order), (B, count), on device."""
        del cache  # the head reads a cache of its own
        self._settle(uids)
        assert self._last is not None
        return _chain(self._drafter, self._last, self._cache, count)

    def accept(self, uids: list[int], hidden: mx.array, tokens: mx.array, kept: list[int], drafted: int) -> None:
        """After a step that drafted *drafted* per row: forget the chains, queue each row's kept positions
        (*hidden* (B, W, H) and the tokens after them, *tokens* (B, W); the first *kept[i]* of row i)."""
        if drafted > 1:
            for layer in self._cache:
                layer.trim(drafted - 1)
        for i, uid in enumerate(uids):
            if uid in self._pending:
                self._pending[uid].append((hidden[i:i + 1, :kept[i]], tokens[i:i + 1, :kept[i]]))

    def settle(self, uids: list[int]) -> list[mx.array]:
        """Read every row's queued pairs now (a bound on what they hold while the batch does not draft)."""
        self._settle(uids)
        return [self._last] if self._last is not None else []

    def _settle(self, uids: list[int]) -> None:
        d = self._drafter
        if uids != self._uids or any(uid in self._joining for uid in uids):
            self._merge(uids)
        counts = [self.pending(uid) for uid in uids]
        if max(counts, default=0) == 0:
            return
        read: dict[int, tuple[mx.array, mx.array]] = {}
        for uid in uids:
            pairs, self._pending[uid] = self._pending[uid], []
            if pairs:
                read[uid] = (mx.concatenate([h for h, _ in pairs], axis=1),
                             mx.concatenate([t for _, t in pairs], axis=1).astype(mx.int32))
                self._read.add(uid)
        like = next(iter(read.values()))[0]
        nothing = (mx.zeros((1, 0, like.shape[-1]), like.dtype), mx.zeros((1, 0), mx.int32))
        rows = [read.get(uid, nothing) for uid in uids]
        # Only each row's last position's output is read: a head that can write the others' keys and values
        # alone (``remember``) runs whole for that one position only.
        remember = getattr(d.head, "remember", None)
        whole = [min(count, 1) for count in counts] if remember is not None else counts
        ahead = [count - own for count, own in zip(counts, whole, strict=True)]
        if remember is not None:
            self._feed(rows, [0] * len(rows), ahead, lambda e, h: remember(e, h, self._cache))
        for out, pieces in self._feed(rows, ahead, whole, lambda e, h: d.head(e, h, self._cache)):
            read_now = mx.array(pieces)
            last = mx.take_along_axis(out, mx.maximum(read_now - 1, 0)[:, None, None], axis=1)
            if self._last is not None:
                last = mx.where((read_now > 0)[:, None, None], last, self._last)
            self._last = last

    def _feed(self, rows: list[tuple[mx.array, mx.array]], first: list[int], counts: list[int],
              forward: Any) -> list[tuple[Any, list[int]]]:
        """Row i's pairs ``first[i]`` to ``first[i] + counts[i]`` through *forward* (embeddings, hidden), all
        rows at once, right-padded to the longest and in pieces of at most :data:`SETTLE_CHUNK` (a long
        prompt's positions in bounded forwards); each piece's output with how many positions each row fed."""
        d, fed = self._drafter, []
        for start in range(0, max(counts, default=0), SETTLE_CHUNK):
            pieces = [min(max(count - start, 0), SETTLE_CHUNK) for count in counts]
            longest = max(pieces)
            hiddens, tokens = [], []
            for (h, t), at, piece in zip(rows, first, pieces, strict=True):
                h, t = h[:, at + start:at + start + piece], t[:, at + start:at + start + piece]
                pad = longest - piece
                hiddens.append(mx.pad(h, [(0, 0), (0, pad), (0, 0)]) if pad else h)
                tokens.append(mx.pad(t, [(0, 0), (0, pad)]) if pad else t)
            padding = [longest - piece for piece in pieces]
            out = forward(d.embed(mx.concatenate(tokens, axis=0)), mx.concatenate(hiddens, axis=0))
            if any(padding):  # taken out as a verify's rejected drafts are: trimmed, or made left padding
                mx.eval(out)  # the forward done first, so that the rotations write their rows in place
                rollback_kv_rows(self._cache, padding)
            fed.append((out, pieces))
        return fed

    def _merge(self, uids: list[int]) -> None:
        """The head caches and last outputs of *uids*, in that order, as one batch."""
        from mlx_lm.models.cache import BatchKVCache

        rows: list[tuple[list[Any], mx.array | None]] = []
        for uid in uids:
            if uid in self._joining:
                sequence = self._joining.pop(uid)
                rows.append((sequence._cache, sequence._last))
            else:
                at = self._uids.index(uid)
                assert self._last is not None
                rows.append(([layer.extract(at) for layer in self._cache], self._last[at:at + 1]))
        self._uids = list(uids)
        self._cache = [BatchKVCache.merge([row[0][i] for row in rows]) for i in range(len(rows[0][0]))]
        lasts = [last for _, last in rows]
        known = next((last for last in lasts if last is not None), None)
        self._last = None if known is None else mx.concatenate(
            [last if last is not None else mx.zeros_like(known) for last in lasts], axis=0)
