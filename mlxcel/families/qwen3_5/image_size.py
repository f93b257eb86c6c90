"""How big Qwen 3.5 sees an image (pure arithmetic: the HTTP layer counts an image's tokens with it, no mlx).

Qwen 3.5's image processor (transformers' ``Qwen2VLImageProcessor``) keeps the aspect ratio and rounds each side to
a multiple of ``patch x merge`` pixels, scaled down to at most ``longest_edge`` pixels in all or up to at least
``shortest_edge`` (the keys name pixel counts, not sides); each ``merge x merge`` block of patches becomes one image
token, and the prompt holds one ``<|image_pad|>`` per token between the template's ``<|vision_start|>`` and
``<|vision_end|>``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ImageGeometry:
    """A checkpoint's image processor settings (``preprocessor_config.json``)."""

    patch: int = 16
    merge: int = 2
    temporal_patch: int = 2
    min_pixels: int = 65_536
    max_pixels: int = 16_777_216


@dataclass(frozen=True)
class Qwen35ImagePrompt:
    """Qwen 3.5's :class:`~mlxcel.models.images.ImagePrompt`: its template writes one ``<|image_pad|>`` per image,
    which becomes as many as the image has tokens (as transformers' processor expands it)."""

    geometry: ImageGeometry
    placeholder: str = "<|image_pad|>"

    def expansion(self, width: int, height: int) -> str:
        return self.placeholder * image_tokens(width, height, self.geometry)


def resized(width: int, height: int, geometry: ImageGeometry) -> tuple[int, int]:
    """The (width, height) Qwen 3.5 resizes a *width* x *height* image to (transformers' ``smart_resize``)."""
    if max(width, height) / min(width, height) > 200:
        raise ValueError(f"a {width} x {height} image is too thin for Qwen 3.5 (aspect ratio above 200)")
    side = geometry.patch * geometry.merge
    new_height, new_width = round(height / side) * side, round(width / side) * side
    if new_height * new_width > geometry.max_pixels:
        beta = math.sqrt(height * width / geometry.max_pixels)
        new_height = max(side, math.floor(height / beta / side) * side)
        new_width = max(side, math.floor(width / beta / side) * side)
    elif new_height * new_width < geometry.min_pixels:
        beta = math.sqrt(geometry.min_pixels / (height * width))
        new_height = math.ceil(height * beta / side) * side
        new_width = math.ceil(width * beta / side) * side
    return new_width, new_height


def grid(width: int, height: int, geometry: ImageGeometry) -> tuple[int, int]:
    """(rows, columns) of patches of a *width* x *height* image, after resizing."""
    new_width, new_height = resized(width, height, geometry)
    return new_height // geometry.patch, new_width // geometry.patch


def image_tokens(width: int, height: int, geometry: ImageGeometry) -> int:
    """The tokens a *width* x *height* image becomes in the prompt."""
    rows, columns = grid(width, height, geometry)
    return rows * columns // geometry.merge ** 2
