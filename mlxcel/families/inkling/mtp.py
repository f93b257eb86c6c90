"""Inkling's multi-token-prediction head, from the unindexed ``mtp.safetensors`` beside the target's shards.

Block i holds ``embed_norm``, ``hidden_norm``, ``input_proj`` (2H -> H) and a ``transformer_block``: an
Inkling decoder layer with a dense MLP, in the raw names (remapped as the target's are,
:func:`mlxcel.families.inkling.weights.remap_layer_weights`). One step, hidden state first in the concat::

    x = block(input_proj([hidden_norm(h) ; embed_norm(embed(token))]))
    logits = target.logits(x)      # the target's final norm, mu-P divide, head, vocabulary slice

where ``h`` is the target's PRE-final-norm hidden state at the position before ``token`` and ``embed``
the target's raw table (without its ``embed_norm``); chained drafts feed ``x`` back as the next ``h``,
through block ``min(step, n - 1)``. Catching up on the target's hidden states always runs block 0.
Each block keeps an :class:`~mlxcel.families.inkling.model.InklingCache`; the chained steps of a round are
undone by restoring the caches as they were before them (keys/values trimmed, convolution states
put back), which single steps then extend with what the target kept.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .model import DecoderLayer, InklingCache, ModelArgs
from .weights import remap_layer_weights

FILE = "mtp.safetensors"
PREFIX = "model.mtp.layers."


class MtpBlock(nn.Module):
    def __init__(self, args: ModelArgs, sliding: bool) -> None:
        super().__init__()
        h = args.hidden_size
        self.embed_norm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.hidden_norm = nn.RMSNorm(h, eps=args.rms_norm_eps)
        self.input_proj = nn.Linear(2 * h, h, bias=False)
        self.transformer_block = DecoderLayer(args, sliding, dense=True)

    def __call__(self, embeddings: mx.array, hidden: mx.array, cache: InklingCache) -> mx.array:
        x = self.input_proj(mx.concatenate([self.hidden_norm(hidden), self.embed_norm(embeddings)], axis=-1))
        out: mx.array = self.transformer_block(x, cache)
        return out


class InklingMTP(nn.Module):
    def __init__(self, args: ModelArgs, count: int) -> None:
        super().__init__()
        local = set(args.mtp_local_layer_ids or ())
        self.layers = [MtpBlock(args, i in local) for i in range(count)]

    def make_cache(self) -> list[InklingCache]:
        return [InklingCache() for _ in self.layers]


def block_count(args: ModelArgs, names: Any) -> int:
    found = {int(n[len(PREFIX):].split(".")[0]) for n in names if n.startswith(PREFIX)}
    return len(found) or int(args.num_mtp_layers or 1)


def build(config: dict[str, Any], weights: dict[str, mx.array]) -> InklingMTP:
    """The head from ``mtp.safetensors``' raw tensors (``model.mtp.layers.N.*``), strictly."""
    args = ModelArgs.from_dict(config)
    head = InklingMTP(args, block_count(args, weights))
    loaded: dict[str, mx.array] = {}
    for name, value in weights.items():
        if not name.startswith(PREFIX):
            continue
        index, rest = name[len(PREFIX):].split(".", 1)
        if rest.startswith("transformer_block."):
            inner = remap_layer_weights(rest.removeprefix("transformer_block."), value, "")
            loaded.update({f"layers.{index}.transformer_block.{k}": v for k, v in inner.items()})
        else:
            loaded[f"layers.{index}.{rest}"] = value
    head.load_weights(list(loaded.items()), strict=True)
    return head


class InklingDrafter:
    """The :class:`~mlxcel.models.speculative.DraftHead`: the head with the target's raw embedding
    table and its logits (final norm, mu-P divide, head, slice)."""

    def __init__(self, head: InklingMTP, target: Any) -> None:
        self.head = head
        self.embed = target.model.embed_tokens
        self.logits = target.logits

    def new_sequence(self, cache: list[Any]) -> InklingSequence:
        del cache  # the head keeps caches of its own
        return InklingSequence(self)


class InklingSequence:
    """One sequence's head state: its block caches, the (hidden, token) pairs not read yet, and the
    block output at the last position read."""

    def __init__(self, drafter: InklingDrafter) -> None:
        self._d = drafter
        self._caches = drafter.head.make_cache()
        self._pending: list[tuple[mx.array, mx.array]] = []
        self._last: mx.array | None = None
        self._saved: list[tuple[int, dict[str, Any]]] | None = None

    @property
    def ready(self) -> bool:
        return self._last is not None or bool(self._pending)

    def _step(self, depth: int, tokens: mx.array, hidden: mx.array) -> mx.array:
        index = min(depth, len(self._caches) - 1)
        out: mx.array = self._d.head.layers[index](self._d.embed(tokens), hidden, self._caches[index])
        return out

    def catch_up(self, hidden: mx.array, tokens: mx.array) -> None:
        self._pending.append((hidden, tokens))  # read together, through block 0, at the next draft

    def settle(self) -> list[mx.array]:
        if self._pending:
            hidden = mx.concatenate([h for h, _ in self._pending], axis=1)
            tokens = mx.concatenate([t for _, t in self._pending], axis=1)
            self._pending = []
            self._last = self._step(0, tokens, hidden)[:, -1:, :]
        return [] if self._last is None else [self._last]

    def draft(self, count: int) -> mx.array:
        self.settle()
        assert self._last is not None
        # What the chained steps change, to put back at accept (MLX arrays are immutable: no copies).
        self._saved = [(c.offset, dict(c.conv)) for c in self._caches]
        out = self._last
        drafts = [mx.argmax(self._d.logits(out), axis=-1)]
        for depth in range(count - 1):
            out = self._step(depth, drafts[-1], out)
            drafts.append(mx.argmax(self._d.logits(out), axis=-1))
        return mx.concatenate(drafts, axis=1)

    def accept(self, hidden: mx.array, tokens: mx.array, drafted: int) -> None:
        if self._saved is not None:
            for cache, (offset, conv) in zip(self._caches, self._saved, strict=True):
                cache.kv.trim(cache.offset - offset)
                cache.conv = conv
            self._saved = None
        self.catch_up(hidden, tokens)

    def snapshot(self) -> Any:
        self.settle()
        return copy.deepcopy((self._caches, self._last))

    def restore(self, state: Any) -> None:
        self._caches, self._last = copy.deepcopy(state)
        self._pending, self._saved = [], None
