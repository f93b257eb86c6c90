"""An embedding model on MLX: mlx-embeddings' model files run the network, the checkpoint's layout pools.

mlx-embeddings (PyPI, the ``embeddings`` extra) carries MLX ports of the encoders people embed with (BERT, XLM-R,
ModernBERT, Qwen3-Embedding, Gemma 3...): chosen over writing them here, as the brief asks of a maintained library.
Its own pooling is fixed per architecture (mean for BERT whatever the checkpoint says), so mlxcel takes the last
hidden states and pools and normalizes as the checkpoint's sentence-transformers files say
(:mod:`.layout`), which is what sentence-transformers itself computes. Worker thread only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .layout import BATCH_TOKENS, EmbeddingLayout


class Encoder:
    """One embedding checkpoint, loaded: its ``tokenizer``, and :meth:`embed` for token lists."""

    def __init__(self, directory: Path, layout: EmbeddingLayout, config: dict[str, Any]) -> None:
        from mlx_embeddings.utils import load_model
        from transformers import AutoTokenizer

        self.layout = layout
        self.model = load_model(directory, model_config=_config_quirks(config), path_to_repo=str(directory))
        self.tokenizer = AutoTokenizer.from_pretrained(directory)
        self.tokenizer.model_max_length = 1 << 62  # the routes bound inputs (a 400); no warning per long text
        pad = config.get("pad_token_id", self.tokenizer.pad_token_id)
        self.pad_id = int(pad) if isinstance(pad, int) else 0

    def embed(self, rows: list[list[int]]) -> np.ndarray:
        """One float32 vector per row, in order: rows of like length share a forward of at most
        :data:`BATCH_TOKENS` padded tokens."""
        out = np.empty((len(rows), self.layout.dimensions), dtype=np.float32)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        start = 0
        while start < len(order):
            end = start + 1
            while end < len(order) and (end + 1 - start) * len(rows[order[end]]) <= BATCH_TOKENS:
                end += 1
            chosen = order[start:end]
            out[chosen] = self._forward([rows[i] for i in chosen])
            start = end
        return out

    def _forward(self, rows: list[list[int]]) -> np.ndarray:
        width = max(len(row) for row in rows)
        ids = np.full((len(rows), width), self.pad_id, dtype=np.int32)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = row  # right-padded: each row's first tokens sit where they would alone
        lengths = mx.array([len(row) for row in rows])
        mask = (mx.arange(width)[None, :] < lengths[:, None]).astype(mx.int32)
        states = self.model(mx.array(ids), attention_mask=mask).last_hidden_state.astype(mx.float32)
        vectors = pool(states, mask, lengths, self.layout.pooling)
        if self.layout.normalize:
            vectors = vectors / mx.maximum(mx.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)
        return np.array(vectors, copy=False)


def _config_quirks(config: dict[str, Any]) -> dict[str, Any]:
    """Config values mlx-embeddings reads under older names: transformers 5 saves the rotary base in
    ``rope_parameters``, where mlx-embeddings' decoders would miss it and take their own default."""
    rope = config.get("rope_parameters")
    if "rope_theta" not in config and isinstance(rope, dict) and isinstance(rope.get("rope_theta"), (int, float)):
        return {"rope_theta": rope["rope_theta"]}
    return {}


def pool(states: mx.array, mask: mx.array, lengths: mx.array, mode: str) -> mx.array:
    """sentence-transformers' pooling *mode* of right-padded *states* (rows, tokens, width)."""
    if mode == "cls":
        return states[:, 0]
    if mode == "lasttoken":
        return mx.take_along_axis(states, (lengths - 1)[:, None, None], axis=1)[:, 0]
    kept = mask[..., None].astype(mx.bool_)
    if mode == "max":
        return mx.max(mx.where(kept, states, -mx.inf), axis=1)
    return mx.sum(mx.where(kept, states, 0.0), axis=1) / lengths[:, None].astype(mx.float32)
