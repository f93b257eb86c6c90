"""Gemma 4 (``gemma4`` with a ``text_config``, and ``gemma4_text``): its config quirk, its sliding-window
cache, and the model as a speculative target.

mlx-lm serves the model; this file adds three things.

- :func:`config_overrides`: transformers 5.x saves the full-attention layers' head size (and key/value
  head count) only under ``per_layer_config``, which mlx-lm does not read; the published checkpoints
  spell it ``global_head_dim``. Either spelling loads.
- :class:`SlidingWindowCache`, installed for every Gemma 4 model by :func:`prepare` (classic decode and
  the burst alike, so both compute over the same cache layout): mlx-lm's rotating cache with
  :data:`SLACK` slots beyond the window. A K-wide verify writes its tokens into the ring *in place*, as K
  single steps would, and masks by position; with the slack, the slots it overwrites hold only tokens no
  query of the block can see, so a rejected round rewinds (:meth:`SlidingWindowCache.rewind`) to exactly
  the state K single steps would have left, past the window too.
- :class:`BatchWindowCache`, what a continuous batch holds a sliding-window layer's rows in (the
  :class:`SlidingWindowCache` of each row merge into one): mlx-lm's left-padded ``BatchKVCache``, its
  window masked by position, its front dropped as it grows. mlx-lm's ``BatchRotatingKVCache`` shares one
  ring index between the rows, so a row's last keys cannot be taken back apart from the others'; here they
  can, as from any batch KV layer (:func:`~mlxcel.models.batch_rollback.rollback_kv_rows`).
- :class:`Gemma4Target`: logits exactly as ``Model.__call__`` computes them (soft-capped), and the final
  normed hidden state, which the ``gemma4_assistant`` drafter reads.
"""

from __future__ import annotations

import types
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, RotatingKVCache

from ...models.batch_rollback import rollback_kv_rows
from ...models.speculative import BlockVerify, Split, split_forward

#: Ring slots beyond the sliding window. A verify block of up to SLACK tokens writes in place and
#: rolls back; larger blocks (prompt chunks) take mlx-lm's concatenating path.
SLACK = 64
TYPES = ("gemma4", "gemma4_text")


def config_overrides(config: dict[str, Any]) -> dict[str, Any]:
    """What mlx-lm must be told on top of *config*: the full-attention geometry from ``per_layer_config``,
    and (``gemma4`` wrapper) the vocabulary size, which mlx-lm reads at the top level only (and
    otherwise assumes 262,144)."""
    nested = isinstance(config.get("text_config"), dict)
    text = dict(config["text_config"]) if nested else dict(config)
    overrides: dict[str, Any] = {}
    if nested and "vocab_size" not in config and "vocab_size" in text:
        overrides["vocab_size"] = text["vocab_size"]
    per_layer = text.get("per_layer_config")
    kinds = text.get("layer_types") or []
    full = [per_layer[str(i)] for i, kind in enumerate(kinds)
            if isinstance(per_layer, dict) and kind == "full_attention" and str(i) in per_layer]
    if full and "global_head_dim" not in text:
        text["global_head_dim"] = full[0].get("head_dim", text.get("head_dim"))
        if "num_key_value_heads" in full[0]:
            text["num_global_key_value_heads"] = full[0]["num_key_value_heads"]
        overrides.update({"text_config": text} if nested else text)
    return overrides


def text_model(model: Any) -> Any:
    """The ``gemma4_text`` model inside *model* (the ``gemma4`` wrapper holds it as ``language_model``)."""
    return getattr(model, "language_model", model)


def prepare(model: Any) -> None:
    """Give *model* :class:`SlidingWindowCache` for its sliding-window layers (in place)."""
    text = text_model(model)
    args = text.args
    first_shared = args.num_hidden_layers - args.num_kv_shared_layers

    def make_cache(self: Any) -> list[Any]:
        return [KVCache() if args.layer_types[i] == "full_attention" else SlidingWindowCache(args.sliding_window)
                for i in range(first_shared)]

    text.make_cache = types.MethodType(make_cache, text)


def adopt_cache(cache: list[Any]) -> list[Any]:
    """*cache* with each of mlx-lm's rotating caches (a batch's ``extract`` makes them) as a
    :class:`SlidingWindowCache` holding the same positions."""
    return [SlidingWindowCache.adopt(c) if type(c) is RotatingKVCache else c for c in cache]


class SlidingWindowCache(RotatingKVCache):
    """A rotating key/value cache of ``window + SLACK`` slots that verify blocks write in place.

    Invariant: the slot of position ``p`` is ``p % max_size`` (and ``_idx`` is ``offset % max_size``), so
    a slot's position follows from the offset alone; masks are built from positions, whatever the slot
    order. Prompt chunks longer than :data:`SLACK` go through mlx-lm's concatenating path and the ring is
    rebuilt after it.
    """

    rows_roll_back = True
    """A batch of these (:class:`BatchWindowCache`) rolls its rows back apart."""

    def __init__(self, window: int) -> None:
        super().__init__(max_size=window + SLACK, keep=0)
        self.window = window

    @classmethod
    def merge(cls, caches: list[SlidingWindowCache]) -> BatchWindowCache:  # type: ignore[override]
        """The rows *caches* as a continuous batch holds them (mlx-lm's batch merges its rows' caches so)."""
        return BatchWindowCache.of_rows(caches)

    def temporal(self) -> tuple[mx.array, mx.array] | None:
        """The keys and values of the last ``min(offset, max_size)`` positions, oldest first (None: empty)."""
        if self.keys is None or self.offset == 0:
            return None
        length = min(self.offset, self.max_size)
        keys, values = self.keys[..., :length, :], self.values[..., :length, :]
        if self.offset > self.max_size:  # the oldest position's slot is the next one written
            keys, values = mx.roll(keys, -self._idx, 2), mx.roll(values, -self._idx, 2)
        return keys, values

    @classmethod
    def from_state(cls, state: Any) -> SlidingWindowCache:
        """The cache whose ``state`` (mlx-lm's rotating cache's) is *state*: a prompt cache file's."""
        cache = cls(0)
        cache.state = state
        cache.window = cache.max_size - SLACK
        return cache

    @classmethod
    def adopt(cls, rotating: RotatingKVCache) -> SlidingWindowCache:
        """The same positions as mlx-lm's *rotating* cache (made with ``max_size = window + SLACK``)."""
        cache = cls(rotating.max_size - SLACK)
        cache.offset = rotating.offset
        if rotating.keys is not None:
            length = min(rotating.offset, rotating.max_size)
            cache.keys = rotating._temporal_order(rotating.keys)[..., -length:, :]
            cache.values = rotating._temporal_order(rotating.values)[..., -length:, :]
            cache._to_ring()
        return cache

    # -- writing ------------------------------------------------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        if keys.shape[2] > SLACK:
            out = self._update_concat(keys, values)
            self._to_ring()
            return out
        return self._write_in_place(keys, values)

    def _write_in_place(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        length, size = keys.shape[2], self.max_size
        needed = min(size, self.offset + length)
        if self.keys is None or self.keys.shape[2] < needed:
            # Grow as mlx-lm's single-token path does (by `step`, up to max_size).
            have = 0 if self.keys is None else self.keys.shape[2]
            grown = have
            while grown < needed:
                grown = min(size, grown + self.step)
            extra_k = mx.zeros((*keys.shape[:2], grown - have, keys.shape[3]), keys.dtype)
            extra_v = mx.zeros((*values.shape[:2], grown - have, values.shape[3]), values.dtype)
            self.keys = extra_k if self.keys is None else mx.concatenate([self.keys, extra_k], axis=2)
            self.values = extra_v if self.values is None else mx.concatenate([self.values, extra_v], axis=2)
        start = self.offset % size
        first = min(length, size - start)
        self.keys[..., start:start + first, :] = keys[..., :first, :]
        self.values[..., start:start + first, :] = values[..., :first, :]
        if first < length:  # wrapped around
            self.keys[..., :length - first, :] = keys[..., first:, :]
            self.values[..., :length - first, :] = values[..., first:, :]
        self.offset += length
        self._idx = self.offset % size
        return self.keys_and_values()

    def _to_ring(self) -> None:
        """After a concatenating update: keep the last max_size positions, each in its own slot."""
        assert self.keys is not None and self.values is not None
        size = self.max_size
        if self.offset > size:
            self.keys = mx.roll(self.keys[..., -size:, :], self.offset % size, 2)
            self.values = mx.roll(self.values[..., -size:, :], self.offset % size, 2)
        self._idx = self.offset % size

    def rewind(self, count: int) -> None:
        """Forget the last *count* tokens (at most :data:`SLACK`): a rejected verify tail."""
        if count > SLACK:
            raise ValueError(f"a sliding-window cache rewinds at most {SLACK} tokens, not {count}")
        self.offset -= count
        self._idx = self.offset % self.max_size

    def trim(self, n: int) -> int:
        n = super().trim(n)  # only while offset < max_size (is_trimmable): positions are slots
        self._idx = self.offset % self.max_size
        return n

    # -- reading ------------------------------------------------------------------------------------

    def positions(self, extra: int = 0) -> mx.array:
        """The position each returned slot holds once *extra* more tokens are written (-1: empty)."""
        last = self.offset + extra - 1
        length = min(last + 1, self.max_size)
        slots = mx.arange(length)
        return last - ((last - slots) % self.max_size)

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False) -> Any:
        if N > SLACK:
            return super().make_mask(N, window_size=window_size, return_array=return_array)
        window = window_size or self.window
        if self.offset + N <= window and not return_array:
            return "causal" if N > 1 else None
        position = self.positions(extra=N)[None, :]
        query = (self.offset + mx.arange(N))[:, None]
        return (position <= query) & (position > query - window)

    def live_state(self) -> list[mx.array]:
        """What decides every later step: the keys and values a next query can still see, by slot
        (the rest zeroed: slack slots hold older tokens, or a rewound block's, and are always masked)."""
        if self.keys is None:
            return []
        position = self.positions()
        visible = (position >= self.offset - self.window - 1)[None, None, :, None]
        length = position.shape[0]
        return [mx.where(visible, self.keys[..., :length, :], 0), mx.where(visible, self.values[..., :length, :], 0),
                mx.array([self.offset])]


class BatchWindowCache(BatchKVCache):
    """A continuous batch's sliding-window layer: mlx-lm's ``BatchKVCache`` (rows right-justified at one
    shared index, each row's unused front masked as left padding, so a column's distance from the index is
    a position's distance in every row and the model's window mask holds), with the front dropped whenever
    it holds a ``step`` more than ``window +`` :data:`SLACK` positions: the window for every later query,
    and the slack for a rejected verify block. A dropped front makes a row's padding negative (all of its
    columns are its own). :meth:`extract` gives a row back as a :class:`SlidingWindowCache`.
    """

    rows_roll_back = True

    def __init__(self, window: int, left_padding: list[int]) -> None:
        super().__init__(left_padding)
        self.window = window

    @classmethod
    def of_rows(cls, rows: list[SlidingWindowCache]) -> BatchWindowCache:
        """*rows* right-justified at one index, each row's positions kept (its RoPE offset included)."""
        held = [row.temporal() for row in rows]
        lengths = [0 if h is None else h[0].shape[2] for h in held]
        longest = max(lengths)
        cache = cls(rows[0].window, [longest - n for n in lengths])
        cache.offset = mx.array([row.offset for row in rows])
        present = [h for h in held if h is not None]
        if not present:
            return cache
        like_keys, like_values = present[0]
        keys = mx.zeros((len(rows), like_keys.shape[1], longest, like_keys.shape[3]), like_keys.dtype)
        values = mx.zeros((len(rows), like_values.shape[1], longest, like_values.shape[3]), like_values.dtype)
        for i, (h, n) in enumerate(zip(held, lengths, strict=True)):
            if h is not None:
                keys[i:i + 1, :, longest - n:] = h[0]
                values[i:i + 1, :, longest - n:] = h[1]
        cache.keys, cache.values, cache._idx = keys, values, longest  # type: ignore[assignment]
        return cache

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        fetched: tuple[mx.array, mx.array] = super().update_and_fetch(keys, values)
        surplus = self._idx - (self.window + SLACK)
        # This step attends over what it fetched; later ones need no more than is kept. Not while a right-padded
        # prompt chunk waits for `finalize`, which rolls each padded row's keys forward by its padding.
        if surplus >= self.step and self._right_padding is None:
            assert self.keys is not None and self.values is not None
            self.keys, self.values = self.keys[..., surplus:, :], self.values[..., surplus:, :]
            self._idx -= surplus
            self.left_padding = self.left_padding - surplus
        return fetched

    def extract(self, idx: int) -> SlidingWindowCache:
        offsets: list[int] = self.offset.tolist()  # type: ignore[assignment]
        paddings: list[int] = self.left_padding.tolist()  # type: ignore[assignment]
        cache = SlidingWindowCache(self.window)
        cache.offset = offsets[idx]
        if self.keys is None or cache.offset == 0:
            return cache
        assert self.values is not None
        length = min(cache.offset, cache.max_size)  # the positions its ring holds, the oldest first
        start = max(self._idx - length, paddings[idx], 0)
        keys, values = self.keys[idx:idx + 1, :, start:self._idx], self.values[idx:idx + 1, :, start:self._idx]
        missing = length - keys.shape[2]
        if missing > 0:  # older than the window (a trim after a dropped front): zeros, never seen, slots kept
            keys = mx.pad(keys, [(0, 0), (0, 0), (missing, 0), (0, 0)])
            values = mx.pad(values, [(0, 0), (0, 0), (missing, 0), (0, 0)])
        cache.keys, cache.values = mx.contiguous(keys), mx.contiguous(values)
        cache._to_ring()
        return cache


class Gemma4Target:
    """The :class:`~mlxcel.models.speculative.SpeculativeTarget` of a Gemma 4 model.

    Requires the caches :func:`prepare` installs (full-attention ``KVCache`` and
    :class:`SlidingWindowCache`); a verify block must be at most ``SLACK`` tokens
    (larger blocks take the concatenating path, which a rewind cannot undo).
    """

    def __init__(self, model: Any) -> None:
        from mlx_lm.models.gemma4_text import logit_softcap

        self.model = model
        self.text = text_model(model)
        self.body = self.text.model
        self._softcap = logit_softcap
        self.embed = self.body.embed_tokens
        window = self.text.args.sliding_window
        #: For the exactness probe: a block that crosses the window's edge, and one that crosses the ring's.
        self.probe_offsets = (window - 2, window + SLACK - 2)

    def forward(self, tokens: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        hidden = self.body(tokens, cache=cache)
        text = self.text
        logits = self.embed.as_linear(hidden) if text.tie_word_embeddings else text.lm_head(hidden)
        if text.final_logit_softcapping is not None:
            logits = self._softcap(text.final_logit_softcapping, logits)
        return logits, hidden

    def verify(self, tokens: mx.array, cache: list[Any], split: Split) -> BlockVerify:
        width = tokens.shape[1]
        if width > SLACK:
            raise ValueError(f"a Gemma 4 verify block is at most {SLACK} tokens, not {width}")
        logits, hidden = split_forward(self.forward, tokens, cache, split, self.model)
        return BlockVerify(logits, hidden, width)

    def rollback_rows(self, cache: list[Any], verify: BlockVerify, kept: list[int]) -> None:
        """A batch's rollback: row i back to the state after the first *kept[i]* tokens of its block (its
        full-attention and sliding-window layers alike are batch KV layers)."""
        rejected = [verify.width - k for k in kept]
        if any(rejected):
            rollback_kv_rows(cache, rejected)

    def rollback(self, cache: list[Any], verify: BlockVerify, kept: int) -> None:
        dropped = verify.width - kept
        if dropped == 0:
            return
        for c in cache:
            if isinstance(c, SlidingWindowCache):
                c.rewind(dropped)
            else:
                c.trim(dropped)
