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
  the full-attention layers stay causal, as transformers builds them. A prompt with images is therefore
  prefilled whole; decoding after it is the text model's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

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
        self.kept = FeatureCache()
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
        return self.module.embed_vision(self.module.vision_tower(self.pixels(image)))[0]

    def cached_features(self, image: PromptImage) -> mx.array:
        """:meth:`features` of *image*, kept by its content's hash (:class:`~mlxcel.models.images.FeatureCache`)."""
        return self.kept.get(image, self._evaluated_features)

    def _evaluated_features(self, pixels: Any) -> mx.array:
        rows = self.features(pixels)
        mx.eval(rows)
        return rows

    def keys(self, ids: list[int], images: tuple[PromptImage, ...]) -> list[int]:
        """:class:`~mlxcel.models.images.VisionPrefill`: keyed by its images (:func:`image_keys`)."""
        return image_keys(ids, images, self.image_token_id)

    chunked = False
    """:meth:`prefill` takes the whole prompt in one forward: an image's bidirectional masks are built for it."""

    def prefill(self, model: Any, ids: list[int], images: tuple[PromptImage, ...], cache: list[Any],
                start: int = 0, step: int | None = None, stop: int | None = None) -> None:
        """:class:`~mlxcel.models.images.VisionPrefill`: *ids* (the prompt but its last token), their images'
        features in place of their image tokens, through *model* into *cache* (empty: *start* 0) in one forward
        (*step* unused, *stop* None)."""
        if start or stop is not None:
            raise ValueError("Gemma 4's image prefill starts from an empty cache")
        from .target import text_model

        inner = text_model(model).model
        plain, embedded = prompt_embeddings(inner, ids, [self.cached_features(image) for image in images],
                                            self.image_token_id)
        masks = image_masks([layer.layer_type for layer in inner.layers], inner.window_size, ids,
                            self.image_token_id) if self.bidirectional else None
        with masked(inner, masks):
            model(plain, cache=cache, input_embeddings=embedded)
        mx.eval([c.state for c in cache])


def prompt_embeddings(text_model: Any, ids: list[int], features: list[mx.array], image_token_id: int,
                      pad_id: int = 0) -> tuple[mx.array, mx.array]:
    """(the ids the per-layer inputs are looked up from, the input embeddings) of a prompt whose image tokens take
    *features*' rows in order; *text_model* is mlx-lm's ``Gemma4TextModel``."""
    tokens = np.asarray(ids)
    where = np.nonzero(tokens == image_token_id)[0]
    rows = mx.concatenate(features, axis=0) if features else mx.zeros((0, 1))
    if len(where) != rows.shape[0]:
        raise ValueError(f"the prompt holds {len(where)} image tokens for {rows.shape[0]} image features")
    plain = mx.array(np.where(tokens == image_token_id, pad_id, tokens)[None])
    embedded = text_model.embed_tokens(plain)
    if len(where):
        embedded[0, mx.array(where)] = (rows / text_model.embed_scale).astype(embedded.dtype)
    return plain, embedded


def image_masks(layer_types: list[str], window: int, ids: list[int], image_token_id: int) -> list[mx.array]:
    """Each layer's boolean mask (True: attends) for a whole prompt, as transformers builds Gemma 4's with
    ``mm_token_type_ids``: causal on full layers; on sliding ones, window and (causal or the same image)."""
    tokens = np.asarray(ids)
    image = tokens == image_token_id
    starts = image & ~np.r_[False, image[:-1]]
    block = np.where(image, np.cumsum(starts) - 1, -1)
    query, key = np.arange(len(tokens))[:, None], np.arange(len(tokens))[None, :]
    causal = key <= query
    same = (block[:, None] == block[None, :]) & (block[:, None] >= 0)
    by_type = {"full_attention": mx.array(causal)[None, None],
               "sliding_attention": mx.array((key > query - window) & (causal | same))[None, None]}
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
