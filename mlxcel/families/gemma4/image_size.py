"""How big Gemma 4 sees an image (pure arithmetic: the HTTP layer counts an image's tokens with it, no mlx).

Gemma 4's image processor keeps the aspect ratio and resizes to the largest height and width that are multiples of
``patch x pooling`` pixels and hold at most ``max_soft_tokens x pooling^2`` patches (small images are scaled up);
each ``pooling x pooling`` block of patches becomes one soft token. An image with a side that would round to nothing
keeps one block on that side and its aspect ratio, up to the budget, on the other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ImageGeometry:
    """A checkpoint's image processor settings (``preprocessor_config.json``)."""

    patch: int = 16
    pooling: int = 3
    max_soft_tokens: int = 280


@dataclass(frozen=True)
class Gemma4ImagePrompt:
    """Gemma 4's :class:`~mlxcel.models.images.ImagePrompt`: its template writes ``<|image|>``, which becomes
    ``<|image>``, one ``<|image|>`` per soft token, ``<image|>`` (as transformers' processor expands it)."""

    geometry: ImageGeometry
    placeholder: str = "<|image|>"
    begin: str = "<|image>"
    end: str = "<image|>"

    def expansion(self, width: int, height: int) -> str:
        return self.begin + self.placeholder * soft_tokens(width, height, self.geometry) + self.end


def resized(width: int, height: int, geometry: ImageGeometry) -> tuple[int, int]:
    """The (width, height) Gemma 4 resizes a *width* x *height* image to."""
    side = geometry.patch * geometry.pooling
    budget = geometry.max_soft_tokens * geometry.pooling ** 2 * geometry.patch ** 2  # pixels
    factor = math.sqrt(budget / (width * height))
    new_height = math.floor(factor * height / side) * side
    new_width = math.floor(factor * width / side) * side
    longest = geometry.max_soft_tokens * side  # one block high: the rest of the budget in width
    if new_height == 0 and new_width == 0:
        raise ValueError(f"a {width} x {height} image cannot be resized for Gemma 4")
    if new_height == 0:
        new_height, new_width = side, min(math.floor(width / height) * side, longest)
    elif new_width == 0:
        new_width, new_height = side, min(math.floor(height / width) * side, longest)
    return new_width, new_height


def soft_tokens(width: int, height: int, geometry: ImageGeometry) -> int:
    """The soft tokens a *width* x *height* image becomes in the prompt."""
    new_width, new_height = resized(width, height, geometry)
    return (new_width // geometry.patch) * (new_height // geometry.patch) // geometry.pooling ** 2
