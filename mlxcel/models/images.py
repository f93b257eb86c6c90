"""What a vision family tells the HTTP layer about its images (no mlx): the protocol :class:`ImagePrompt`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class PromptImage:
    """One image of a prompt, as the worker gets it: its content's hash (what its features are cached by) and its
    pixels (a Pillow RGB image)."""

    digest: str
    pixels: Any = field(compare=False, repr=False)


class ImagePrompt(Protocol):
    """How a vision model's prompt holds an image: the marker its chat template writes for one, and the text that
    marker becomes for an image of a given size (its begin and end markers around as many image tokens as the
    model's vision tower gives rows)."""

    placeholder: str

    def expansion(self, width: int, height: int) -> str: ...


class VisionPrefill(Protocol):
    """A vision model's image prefill (worker thread): its prompt but the last token, images included, into a
    fresh cache, whole."""

    def prefill(self, model: Any, ids: list[int], images: tuple[PromptImage, ...], cache: list[Any]) -> None: ...
