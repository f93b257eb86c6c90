"""Qwen 3.5's images, on the worker thread: pixels, features, and the prompt's multi-axis positions.

- **Pixels**: resized as Qwen 3.5's processor does (:mod:`.image_size`, bicubic), scaled to [-1, 1], cut into
  ``patch x patch`` patches (each repeated over the ``temporal_patch`` frames of a video), ordered so that each
  ``merge x merge`` block of patches is contiguous: transformers' ``patchify``.
- **Features**: mlx-vlm's Qwen 3.5 vision tower (``VisionModel``, the library made for it, with its patch merger),
  loaded alone from the checkpoint's ``model.visual.*`` weights beside the text model mlxcel runs through mlx-lm.
  One row per image token, of the text width.
- **Positions**: Qwen 3.5 places a prompt's tokens on three axes (time, row, column; interleaved multi-axis RoPE,
  ``mrope_section``): text on all three alike, an image's tokens on its grid, starting where the text before it
  stopped, and the text after an image resumes after the image's largest side, not after its token count. So the
  positions after an image lag the tokens' count. mlxcel shifts every position of the prompt by one constant so
  that its last token sits at its own index: rotary attention sees only differences of positions, so the shift
  changes no score, and every step after the prompt (decode, the batch, MTP's verify and drafts, rollback) runs at
  the cache's own offset, as for text. The linear-attention layers' recurrence goes in chunks on the CPU
  (:mod:`.chunked_delta`). The shift depends on all of the prompt's images, so the prefix cache keys
  it (:meth:`Qwen35Vision.keys`): a later turn that adds an image prefills its conversation again (its earlier
  images' features come from the feature cache), one that resends the same images resumes after them.
"""

from __future__ import annotations

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
from .chunked_delta import chunked_recurrence
from .image_size import ImageGeometry, resized

#: Where a checkpoint keeps its vision tower: transformers' layout, then mlx-community's conversions.
TOWER_PREFIXES = ("model.visual.", "visual.", "vision_tower.")


class Qwen35Vision:
    """The vision half of a Qwen 3.5 checkpoint at *directory* (its ``config.json`` is *config*)."""

    def __init__(self, directory: Path, config: dict[str, Any], geometry: ImageGeometry) -> None:
        from mlx_vlm.models.qwen3_5.config import VisionConfig
        from mlx_vlm.models.qwen3_5.vision import VisionModel

        vision = dict(config["vision_config"])
        vision.setdefault("model_type", "qwen3_5")
        self.tower = VisionModel(VisionConfig.from_dict(vision))
        self.geometry = geometry
        self.image_token_id = int(config["image_token_id"])
        text = config.get("text_config", config)
        self.sections = tuple(int(n) for n in (text.get("rope_parameters") or {}).get("mrope_section", (11, 11, 10)))
        weights: dict[str, mx.array] = {}
        for file in sorted(directory.glob("*.safetensors")):
            tensors = mx.load(str(file))
            assert isinstance(tensors, dict)
            for key, value in tensors.items():
                prefix = next((p for p in TOWER_PREFIXES if key.startswith(p)), None)
                if prefix is not None:
                    weights[key[len(prefix):]] = value
        self.tower.load_weights(list(self.tower.sanitize(weights).items()))
        mx.eval(self.tower.parameters())
        self.kept = FeatureCache(mx.eval)
        """Images' features by content hash (:meth:`cached_features`)."""

    def patches(self, image: Any) -> tuple[mx.array, tuple[int, int, int]]:
        """A Pillow RGB *image* as the tower takes it: one row per patch, and its (frames, rows, columns) grid."""
        from PIL import Image

        width, height = resized(image.width, image.height, self.geometry)
        if (width, height) != image.size:
            image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
        pixels = (np.asarray(image, dtype=np.float32).transpose(2, 0, 1) / 255.0 - 0.5) / 0.5
        patch, merge, frames = self.geometry.patch, self.geometry.merge, self.geometry.temporal_patch
        rows, columns = height // patch, width // patch
        blocks = pixels.reshape(3, rows // merge, merge, patch, columns // merge, merge, patch)
        blocks = blocks.transpose(1, 4, 2, 5, 0, 3, 6)[:, :, :, :, :, None]  # (rows, cols, mr, mc, C, T, p, p)
        blocks = np.broadcast_to(blocks, (*blocks.shape[:5], frames, patch, patch))
        return mx.array(blocks.reshape(rows * columns, 3 * frames * patch * patch)), (1, rows, columns)

    def features(self, image: Any) -> mx.array:
        """One row per image token of *image* (Pillow RGB), in the text model's width."""
        patches, grid = self.patches(image)
        with numpy_tower():
            rows, _ = self.tower(patches, mx.array([grid]))
        return rows

    def cached_features(self, image: PromptImage) -> mx.array:
        """:meth:`features` of *image*, kept by its content's hash (:class:`~mlxcel.models.images.FeatureCache`)."""
        return self.kept.get(image, self.features)

    def grids(self, images: tuple[PromptImage, ...]) -> list[tuple[int, int, int]]:
        """Each image's (frames, rows, columns) of image tokens."""
        merge = self.geometry.merge
        out = []
        for image in images:
            width, height = resized(image.pixels.width, image.pixels.height, self.geometry)
            out.append((1, height // self.geometry.patch // merge, width // self.geometry.patch // merge))
        return out

    def keys(self, ids: list[int], images: tuple[PromptImage, ...]) -> list[int]:
        """:class:`~mlxcel.models.images.VisionPrefill`: the prompt *ids* as the prefix cache keys it: by its
        images (:func:`~mlxcel.models.images.image_keys`), and its first key by the shift of its positions too
        (module docstring), so that prompts whose tokens sit at other positions share nothing."""
        keyed = image_keys(ids, images, self.image_token_id)
        _, following = rope_positions(ids, self.image_token_id, self.grids(images))
        if (shift := len(ids) - following) and keyed:
            keyed[0] = -((1 << 61) + ((shift % (1 << 20)) << 32) + ids[0])  # beyond image_keys' range
        return keyed

    def prefill(self, model: Any, ids: list[int], images: tuple[PromptImage, ...], cache: list[Any],
                start: int = 0, step: int | None = None, stop: int | None = None) -> None:
        """:class:`~mlxcel.models.images.VisionPrefill`: *ids* (the prompt but its last token) from *start* (what
        *cache* holds already) to *stop* (its end), their images' features in place of their image tokens, at
        their shifted positions (the next token's is its index), through *model* into *cache*, *step* tokens a
        forward (a long prompt's attention stays bounded, as a text prefill's)."""
        positions, following = rope_positions(ids, self.image_token_id, self.grids(images))
        shift = len(ids) - following
        body = model.language_model.model if hasattr(model, "language_model") else model.model
        tokens = np.asarray(ids)
        where, features = image_rows(tokens, self.image_token_id, [self.cached_features(image) for image in images])
        step, stop = step or len(ids), len(ids) if stop is None else stop
        for begin in range(start, stop, step):
            end = min(begin + step, stop)
            chunk = mx.array(tokens[None, begin:end])
            embedded = body.embed_tokens(chunk)
            inside = where[(where >= begin) & (where < end)]
            if len(inside):  # an image token's row: its rank among the prompt's image tokens
                embedded[0, mx.array(inside - begin)] = features[mx.array(np.searchsorted(where, inside))].astype(
                    embedded.dtype)
            with positioned(body, mx.array(positions[:, begin:end] + shift), self.sections), chunked_recurrence(body):
                model(chunk, cache=cache, input_embeddings=embedded)
            mx.eval([c.state for c in cache])


def rope_positions(ids: list[int], image_token_id: int, grids: list[tuple[int, int, int]]) -> tuple[np.ndarray, int]:
    """(3, len(ids)) positions of a prompt on the time, row and column axes, as transformers' ``get_rope_index``
    places them: text on all three alike, counting on; the *k*-th image's tokens (the next ``t * h * w`` image
    tokens, *grids[k]* in image tokens) on its grid from where the text stopped; the text after it from there plus
    the image's largest side. And the position of a token that would follow."""
    out = np.zeros((3, len(ids)), dtype=np.int64)
    at, index, images = 0, 0, iter(grids)
    while index < len(ids):
        if ids[index] != image_token_id:
            out[:, index] = at
            at, index = at + 1, index + 1
            continue
        frames, rows, columns = next(images)
        t, h, w = np.meshgrid(np.arange(frames), np.arange(rows), np.arange(columns), indexing="ij")
        span = frames * rows * columns
        out[:, index:index + span] = np.stack([t.ravel(), h.ravel(), w.ravel()]) + at
        at, index = at + max(rows, columns), index + span
    return out, at


class _AxisRope(nn.Module):
    """A full-attention layer's rotary embedding at given multi-axis positions (a prefill with images), as
    transformers' interleaved M-RoPE computes it: frequency *j* turns by the row position where ``j % 3 == 1``
    (within ``3 * sections[1]``), by the column where ``j % 3 == 2`` (within ``3 * sections[2]``), else by time."""

    def __init__(self, inner: nn.RoPE, positions: mx.array, sections: tuple[int, ...]) -> None:
        super().__init__()
        dims, half = inner.dims, inner.dims // 2
        axis = np.zeros(half, dtype=np.int64)
        for which in (1, 2):
            axis[which:3 * sections[which]:3] = which
        inverse = 1.0 / (inner.base ** (np.arange(0, dims, 2, dtype=np.float32) / dims))
        angles = positions.astype(mx.float32)[mx.array(axis), :].T * mx.array(inverse)  # (L, half)
        self.dims, self.cos, self.sin = dims, mx.cos(angles), mx.sin(angles)

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        half = self.dims // 2
        first, second, rest = x[..., :half], x[..., half:self.dims], x[..., self.dims:]
        cos, sin = self.cos.astype(x.dtype), self.sin.astype(x.dtype)
        return mx.concatenate([first * cos - second * sin, second * cos + first * sin, rest], axis=-1)


@contextmanager
def positioned(body: Any, positions: mx.array, sections: tuple[int, ...]) -> Iterator[None]:
    """Calls of *body* (mlx-lm's ``Qwen3_5TextModel``, worker thread only) place their tokens at *positions*
    (3, L) inside the block: each full-attention layer's rotary embedding is swapped for an :class:`_AxisRope`."""
    swapped = [layer.self_attn for layer in body.layers if not getattr(layer, "is_linear", False)]
    originals = [attention.rope for attention in swapped]
    try:
        for attention, rope in zip(swapped, originals, strict=True):
            attention.rope = _AxisRope(rope, positions, sections)
        yield
    finally:
        for attention, rope in zip(swapped, originals, strict=True):
            attention.rope = rope
