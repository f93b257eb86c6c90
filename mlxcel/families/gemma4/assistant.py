"""Gemma 4's assistant drafter (``gemma4_assistant``, ``gemma4_unified_assistant``).

A separate checkpoint: a small ``gemma4_text`` stack whose every layer is KV-shared (no key or value
projections), ``pre_projection`` / ``post_projection`` between it and the target's width, and a tied
head (or, on the E2B/E4B assistants, a centroid head). It has no cache of its own: each layer's query
attends into the *target's* keys and values, those of the target's last full-attention layer or its
last sliding-window layer, by the layer's kind. One draft step, from the last verified state::

    x = pre_projection([target_embed(token) * sqrt(target_hidden) ; h])
    g = norm(layers(x))                 # queries rotated at the token's position, frozen for the round
    h' = post_projection(g)             # fed back as the next step's h
    logits = embed_tokens.as_linear(g)  # or the centroid head

where ``token`` is the next token to verify (not yet in the target's cache), at position P = the
cache's length, and ``h`` the target's final normed hidden state at P - 1. Every step of a round uses
the same position and the same keys (transformers' ``SinglePositionMultiTokenCandidateGenerator``).
The sliding layers see the last ``window +`` :data:`SLIDING_EXTRA` cached positions, as transformers' reference
mask does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.gemma4_text import DecoderLayer, ModelArgs

from .target import BatchWindowCache, SlidingWindowCache, config_overrides, text_model

TYPES = ("gemma4_assistant", "gemma4_unified_assistant")
#: Cached positions a sliding layer of the assistant sees: transformers' bidirectional sliding mask
#: admits |q - k| <= window, so the window plus one (the position P itself is not cached).
SLIDING_EXTRA = 1


@dataclass(frozen=True, slots=True)
class AssistantConfig:
    text: ModelArgs
    backbone_hidden_size: int
    tie_word_embeddings: bool
    use_ordered_embeddings: bool
    num_centroids: int
    centroid_intermediate_top_k: int
    block_size: int

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> AssistantConfig:
        text = dict(config["text_config"])
        text.update(config_overrides({"text_config": text}).get("text_config", {}))
        # Every layer reads the target's keys and values (transformers forces this too).
        text.update(num_kv_shared_layers=text["num_hidden_layers"], use_double_wide_mlp=False,
                    hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, enable_moe_block=False)
        return cls(text=ModelArgs.from_dict(text), backbone_hidden_size=int(config["backbone_hidden_size"]),
                   tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
                   use_ordered_embeddings=bool(config.get("use_ordered_embeddings", False)),
                   num_centroids=int(config.get("num_centroids", 2048)),
                   centroid_intermediate_top_k=int(config.get("centroid_intermediate_top_k", 32)),
                   block_size=int(config.get("block_size", 4)))


class _Backbone(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, layer_idx=i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class CentroidHead(nn.Module):
    """The E2B/E4B assistants' head: score clusters of the vocabulary, then only the tokens of the
    top clusters; every other token gets the minimum selected logit minus one."""

    def __init__(self, hidden: int, vocab: int, centroids: int, top_k: int) -> None:
        super().__init__()
        self.centroids = nn.Linear(hidden, centroids, bias=False)
        self.token_ordering = mx.zeros((vocab,), dtype=mx.int32)
        self._top_k = top_k

    def __call__(self, hidden: mx.array, table: mx.array) -> mx.array:
        batch, length, _ = hidden.shape
        clusters = self.centroids.weight.shape[0]
        vocab = self.token_ordering.shape[0]
        scores = self.centroids(hidden)
        top = mx.argpartition(-scores, kth=self._top_k - 1, axis=-1)[..., :self._top_k]
        tokens = self.token_ordering.reshape(clusters, vocab // clusters)[top].reshape(batch, length, -1)
        selected = (hidden[..., None, :] @ table[tokens].swapaxes(-1, -2)).squeeze(-2)
        full = mx.full((batch, length, vocab), selected.min() - 1.0, dtype=selected.dtype)
        return mx.put_along_axis(full, tokens, selected, axis=-1)


class Gemma4Assistant(nn.Module):
    def __init__(self, config: AssistantConfig) -> None:
        super().__init__()
        args = config.text
        self.config = config
        self.model = _Backbone(args)
        self.pre_projection = nn.Linear(2 * config.backbone_hidden_size, args.hidden_size, bias=False)
        self.post_projection = nn.Linear(args.hidden_size, config.backbone_hidden_size, bias=False)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if config.use_ordered_embeddings:
            self.masked_embedding = CentroidHead(args.hidden_size, args.vocab_size, config.num_centroids,
                                                 config.centroid_intermediate_top_k)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = {}
        for name, value in weights.items():
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the embedding table is the head
            out[name] = value.astype(mx.int32) if name.endswith("token_ordering") else value
        return out

    def __call__(self, inputs: mx.array, shared: dict[str, tuple[mx.array, mx.array]],
                 masks: dict[str, Any], position: int) -> tuple[mx.array, mx.array]:
        """(the hidden state fed back, logits) for *inputs* (1, 1, 2 * backbone) at *position*."""
        h = self.pre_projection(inputs)
        for layer in self.model.layers:
            h, _, _ = layer(h, masks[layer.layer_type], None, shared_kv=shared[layer.layer_type], offset=position)
        h = self.model.norm(h)
        table = self.model.embed_tokens
        if self.config.use_ordered_embeddings:
            logits = self.masked_embedding(h, table.weight)
        elif self.config.tie_word_embeddings:
            logits = table.as_linear(h)
        else:
            logits = self.lm_head(h)
        return self.post_projection(h), logits


def read_config(directory: Path) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    return config


def build(directory: Path) -> Gemma4Assistant:
    """The assistant in *directory* (its ``config.json`` and safetensors), weights loaded strictly."""
    assistant = Gemma4Assistant(AssistantConfig.from_dict(read_config(directory)))
    weights: dict[str, mx.array] = {}
    for file in sorted(directory.glob("*.safetensors")):
        weights.update(mx.load(str(file)))  # type: ignore[arg-type]
    assistant.load_weights(list(assistant.sanitize(weights).items()), strict=True)
    return assistant


class Gemma4AssistantDrafter:
    """The :class:`~mlxcel.models.speculative.DraftHead` of a Gemma 4 target: the assistant, the target's
    input embedding, and which of the target's caches each kind of layer attends into."""

    def __init__(self, assistant: Gemma4Assistant, target: Any) -> None:
        text = text_model(target)
        args = text.args
        if assistant.config.backbone_hidden_size != args.hidden_size:
            raise ValueError(f"the assistant was trained for a {assistant.config.backbone_hidden_size}-wide "
                             f"target, not {args.hidden_size}")
        self.assistant = assistant
        self.embed = text.model.embed_tokens
        self.embed_scale = text.model.embed_scale
        producers = args.layer_types[:args.num_hidden_layers - args.num_kv_shared_layers]
        # The last cache-producing layer of each kind: the ones transformers' assistant reads.
        self.sources = {kind: max(i for i, k in enumerate(producers) if k == kind) for kind in set(producers)}
        self.window = args.sliding_window

    def new_sequence(self, cache: list[Any]) -> _SequenceDrafter:
        return _SequenceDrafter(self, cache)

    def new_batch(self) -> _BatchDrafter:
        return _BatchDrafter(self)

    def chain(self, token: mx.array, hidden: mx.array, shared: dict[str, tuple[mx.array, mx.array]],
              masks: dict[str, Any], position: Any, count: int) -> mx.array:
        """*count* greedy drafts (rows, count) from each row's next *token* (rows, 1) and the target's hidden
        state before it (rows, 1, H), every step at the same *position* against the same keys."""
        drafts = []
        for _ in range(count):
            inputs = mx.concatenate([self.embed(token) * self.embed_scale, hidden], axis=-1)
            hidden, logits = self.assistant(inputs, shared, masks, position)
            token = mx.argmax(logits, axis=-1).astype(mx.int32)
            drafts.append(token)
        return mx.concatenate(drafts, axis=1)


class _SequenceDrafter:
    """One sequence: the target's cache it reads, and the last (hidden state, token) pair."""

    def __init__(self, drafter: Gemma4AssistantDrafter, cache: list[Any]) -> None:
        self._drafter = drafter
        self._cache = cache
        self._hidden: mx.array | None = None
        self._token: mx.array | None = None

    @property
    def ready(self) -> bool:
        return self._hidden is not None

    def catch_up(self, hidden: mx.array, tokens: mx.array) -> None:
        self._hidden, self._token = hidden[:, -1:, :], tokens[:, -1:].astype(mx.int32)

    def settle(self) -> list[mx.array]:
        return []  # nothing deferred: a draft reads the target's state as it is

    def _shared(self) -> tuple[dict[str, tuple[mx.array, mx.array]], dict[str, Any], int]:
        shared, masks = {}, {}
        position = 0
        for kind, index in self._drafter.sources.items():
            c = self._cache[index]
            position = c.offset
            if isinstance(c, SlidingWindowCache):
                length = min(c.offset, c.max_size)
                slots = c.positions()
                shared[kind] = (c.keys[..., :length, :], c.values[..., :length, :])
                visible = self._drafter.window + SLIDING_EXTRA
                masks[kind] = (slots >= c.offset - visible)[None, :] if c.offset > visible else None
            else:
                shared[kind] = (c.keys[..., :c.offset, :], c.values[..., :c.offset, :])
                masks[kind] = None
        return shared, masks, position

    def draft(self, count: int) -> mx.array:
        assert self._hidden is not None and self._token is not None
        shared, masks, position = self._shared()
        return self._drafter.chain(self._token, self._hidden, shared, masks, position, count)

    def accept(self, hidden: mx.array, tokens: mx.array, drafted: int) -> None:
        del drafted  # no cache of its own to trim
        self.catch_up(hidden, tokens)

    def snapshot(self) -> Any:
        return self._hidden, self._token  # arrays are values: the pair as it is

    def restore(self, state: Any) -> None:
        self._hidden, self._token = state


class _BatchDrafter:
    """A continuous batch's rows drafting together: each row's last (hidden state, next token) pair, and the
    batch's own caches, which every row's query reads with its padding, and beyond the sliding layers'
    window, masked (the batch holds both kinds as left-padded KV layers right-justified at one index)."""

    def __init__(self, drafter: Gemma4AssistantDrafter) -> None:
        self._drafter = drafter
        self._last: dict[int, tuple[mx.array, mx.array]] = {}

    def join(self, uid: int, sequence: _SequenceDrafter | None) -> None:
        if sequence is not None and sequence._hidden is not None and sequence._token is not None:
            self._last[uid] = (sequence._hidden, sequence._token)

    def leave(self, uid: int) -> None:
        self._last.pop(uid, None)

    def ready(self, uid: int) -> bool:
        return uid in self._last

    def pending(self, uid: int) -> int:
        return 0  # nothing deferred

    def catch_up(self, uid: int, hidden: mx.array, tokens: mx.array) -> None:
        self._last[uid] = (hidden[:, -1:, :], tokens[:, -1:].astype(mx.int32))

    def settle(self, uids: list[int]) -> list[mx.array]:
        return []

    def draft(self, uids: list[int], count: int, cache: list[Any]) -> mx.array:
        d = self._drafter
        shared, masks, position = {}, {}, None
        for kind, index in d.sources.items():
            layer = cache[index]
            width = layer.size()
            shared[kind] = (layer.keys[..., :width, :], layer.values[..., :width, :])
            columns = mx.arange(width)[None, :]
            visible = columns >= layer.left_padding[:, None]
            if isinstance(layer, BatchWindowCache):
                visible = visible & (columns >= width - d.window - SLIDING_EXTRA)
            masks[kind] = visible[:, None, None, :]
            position = layer.offset
        token = mx.concatenate([self._last[uid][1] for uid in uids], axis=0)
        hidden = mx.concatenate([self._last[uid][0] for uid in uids], axis=0)
        return d.chain(token, hidden, shared, masks, position, count)

    def accept(self, uids: list[int], hidden: mx.array, tokens: mx.array, kept: list[int], drafted: int) -> None:
        del drafted  # no cache of its own to trim
        for i, (uid, k) in enumerate(zip(uids, kept, strict=True)):
            self._last[uid] = (hidden[i:i + 1, k - 1:k, :], tokens[i:i + 1, k - 1:k].astype(mx.int32))


def load(directory: Path, target: Any) -> Gemma4AssistantDrafter:
    """The drafter in *directory* for the loaded target (tests and benchmarks; the server loads through
    :func:`mlxcel.models.drafters.loader.load_drafter`)."""
    assistant = build(directory)
    mx.eval(assistant.parameters())
    return Gemma4AssistantDrafter(assistant, target)
