"""Gemma 4's images, on the worker thread: pixels, features, and the prompt's embeddings and masks.

- **Pixels**: resized as Gemma 4's processor does (:mod:`.image_size`, bicubic), scaled to [0, 1], channels first.
- **Features**: mlx-vlm's Gemma 4 vision tower and projection (``VisionModel``, ``MultimodalEmbedder``: the
  library made for it), loaded alone from the checkpoint's ``model.vision_tower.*`` and ``model.embed_vision.*``
  weights, beside the text model mlxcel already runs through mlx-lm. One row per soft token, of the text width.
- **Embeddings**: the text model scales its input embeddings by sqrt(hidden) itself, and an image's features are
  not scaled in Gemma 4, so they go in divided by it; its per-layer inputs are looked up from the token ids with
  the image tokens set to padding, as transformers does.
- **Masks**: where the checkpoint says ``use_bidirectional_attention: "vision"`` (Gemma 4 12B and larger), the
  sliding-window layers let an image's soft tokens see each other whole (window and (causal or the same image));
  the full-attention layers stay causal, as transformers builds them. So the text before a prompt's first image
  is prefilled in steps as any prompt's, and the rest in one forward, with masks built for the positions the
  cache holds; decoding after it is the text model's own.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...models.cpu_tower import numpy_tower
from ...models.image_rows import image_rows
from ...models.images import FeatureCache, PromptImage, image_keys
from .image_size import ImageGeometry, resized


class Gemma4Vision:
    """The vision half of a Gemma 4 checkpoint at *directory* (its ``config.json`` is *config*)."""

    def __init__(self, directory: Path, config: dict[str, Any], geometry: ImageGeometry) -> None:
        from mlx_vlm.models.gemma4.config import VisionConfig
        from mlx_vlm.models.gemma4.gemma4 import MultimodalEmbedder
        from mlx_vlm.models.gemma4.vision import VisionModel

        vision = VisionConfig.from_dict(config["vision_config"])
        self.geometry = geometry
        self.image_token_id = int(config["image_token_id"])
        self.bidirectional = config.get("text_config", {}).get("use_bidirectional_attention") == "vision"
        self.module = nn.Module()
        self.module.vision_tower = VisionModel(vision)
        self.module.embed_vision = MultimodalEmbedder(vision.hidden_size, int(config["text_config"]["hidden_size"]),
                                                      eps=vision.rms_norm_eps)
        clipped = bool(getattr(vision, "use_clipped_linears", False))
        weights: dict[str, mx.array] = {}
        for file in sorted(directory.glob("model*.safetensors")):
            tensors = mx.load(str(file))
            assert isinstance(tensors, dict)
            for key, value in tensors.items():
                name = key.removeprefix("model.")
                if not name.startswith(("vision_tower.", "embed_vision.")) or "rotary_emb" in name:
                    continue
                if not clipped and any(s in name for s in ("input_max", "input_min", "output_max", "output_min")):
                    continue
                weights[name] = value
        self.module.load_weights(list(weights.items()))
        mx.eval(self.module.parameters())
        self.kept = FeatureCache(mx.eval)
        """Images' features by content hash (:meth:`cached_features`)."""

    def pixels(self, image: Any) -> mx.array:
        """A Pillow RGB *image* as the tower takes it: (1, 3, height, width), in [0, 1]."""
        from PIL import Image

        width, height = resized(image.width, image.height, self.geometry)
        if (width, height) != image.size:
            image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
        data = np.asarray(image, dtype=np.float32) / 255.0
        return mx.array(data.transpose(2, 0, 1)[None])

    def features(self, image: Any) -> mx.array:
        """One row per soft token of *image* (Pillow RGB), in the text model's width."""
        with numpy_tower():
            return self.module.embed_vision(self.module.vision_tower(self.pixels(image)))[0]

    def cached_features(self, image: PromptImage) -> mx.array:
        """:meth:`features` of *image*, kept by its content's hash (:class:`~mlxcel.models.images.FeatureCache`)."""
        return self.kept.get(image, self.features)

    def keys(self, ids: list[int], images: tuple[PromptImage, ...]) -> list[int]:
        """:class:`~mlxcel.models.images.VisionPrefill`: keyed by its images (:func:`image_keys`)."""
        return image_keys(ids, images, self.image_token_id)

    def prefill(self, model: Any, ids: list[int], images: tuple[PromptImage, ...], cache: list[Any],
                start: int = 0, step: int | None = None, stop: int | None = None) -> None:
        """:class:`~mlxcel.models.images.VisionPrefill`: *ids* (the prompt but its last token) from *start* (what
        *cache* holds already) to *stop* (its end), their images' features in place of their image tokens,
        through *model* into *cache*. Text before the first image goes *step* tokens a forward, as any prompt's;
        the rest in one forward where the images' bidirectional masks apply (they are built for the positions the
        cache holds), else in steps too."""
        from .target import text_model

        inner = text_model(model).model
        stop = len(ids) if stop is None else stop
        step = step or len(ids)
        tokens = np.asarray(ids)
        where, rows = image_rows(tokens, self.image_token_id, [self.cached_features(image) for image in images])
        split = min(int(where[0]) if len(where) else stop, stop) if self.bidirectional else stop
        bounds = [*range(start, split, step), split]
        if split < stop:
            bounds.append(stop)  # the images and the text after them, in one forward
        types = [layer.layer_type for layer in inner.layers]
        for begin, end in itertools.pairwise(bounds):
            if begin >= end:
                continue
            inside = (where >= begin) & (where < end)
            plain, embedded = prompt_embeddings(inner, ids[begin:end], [rows[mx.array(np.nonzero(inside)[0])]]
                                                if inside.any() else [], self.image_token_id)
            masks = None
            if self.bidirectional and inside.any():
                keys = {kind: key_positions(cache[types.index(kind)], end - begin) for kind in set(types)}
                masks = image_masks(types, inner.window_size, ids[:end], self.image_token_id, begin, keys)
            with masked(inner, masks):
                model(plain, cache=cache, input_embeddings=embedded)
            mx.eval([c.state for c in cache])


def key_positions(cache: Any, count: int) -> np.ndarray:
    """The prompt position of each key *cache* (a layer's) returns when *count* more tokens are written to it."""
    from .target import SLACK, SlidingWindowCache

    if isinstance(cache, SlidingWindowCache):
        if count <= SLACK:  # written in place: the ring's slots, in slot order
            return np.array(cache.positions(extra=count))
        kept = min(cache.max_size - 1, cache.offset)  # mlx-lm's concatenating path keeps this much before
    else:
        kept = cache.offset
    return cache.offset - kept + np.arange(kept + count)


def prompt_embeddings(text_model: Any, ids: list[int], features: list[mx.array], image_token_id: int,
                      pad_id: int = 0) -> tuple[mx.array, mx.array]:
    """(the ids the per-layer inputs are looked up from, the input embeddings) of a prompt whose image tokens take
    *features*' rows in order; *text_model* is mlx-lm's ``Gemma4TextModel``."""
    tokens = np.asarray(ids)
    where, rows = image_rows(tokens, image_token_id, features)
    plain = mx.array(np.where(tokens == image_token_id, pad_id, tokens)[None])
    embedded = text_model.embed_tokens(plain)
    if len(where):
        embedded[0, mx.array(where)] = (rows / text_model.embed_scale).astype(embedded.dtype)
    return plain, embedded


def image_masks(layer_types: list[str], window: int, ids: list[int], image_token_id: int, start: int = 0,
                keys: dict[str, np.ndarray] | None = None) -> list[mx.array]:
    """Each layer's boolean mask (True: attends) for the queries *ids[start:]*, as transformers builds Gemma 4's
    with ``mm_token_type_ids``: causal on full layers; on sliding ones, window and (causal or the same image).
    *keys*: each layer type's key positions, as its cache returns them (default: the prompt's, from 0); a slot
    that holds no position (-1) is never attended."""
    tokens = np.asarray(ids)
    image = tokens == image_token_id
    starts = image & ~np.r_[False, image[:-1]]
    block = np.append(np.where(image, np.cumsum(starts) - 1, -1), -1)  # [-1]: an empty slot's, no image
    query = np.arange(start, len(tokens))[:, None]
    by_type = {}
    for kind in set(layer_types):
        key = (keys or {}).get(kind, np.arange(len(tokens)))[None, :]
        attends = (key <= query) & (key >= 0)
        if kind == "sliding_attention":
            same = (block[query] == block[key]) & (block[query] >= 0)
            attends = (key > query - window) & (key >= 0) & (attends | same)
        by_type[kind] = mx.array(attends)[None, None]
    return [by_type[kind] for kind in layer_types]


@contextmanager
def masked(text_model: Any, masks: list[mx.array] | None) -> Iterator[None]:
    """Calls of *text_model* (mlx-lm's ``Gemma4TextModel``, worker thread only) use *masks* inside the block (None:
    its own, a causal checkpoint's): it takes no mask argument, so its instance's ``_make_masks`` is shadowed."""
    if masks is None:
        yield
        return
    text_model._make_masks = lambda h, cache: masks
    try:
        yield
    finally:
        del text_model._make_masks
