"""What a vision family tells the HTTP layer about its images (no mlx): the protocol :class:`ImagePrompt`."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

#: Bytes of image features a vision model keeps for images sent again (by content hash); charged against a memory
#: budget with the model. A 280-token image of a 5,376-wide model's is 6 MB.
FEATURE_CACHE_BYTES = 256 << 20


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


class FeatureCache:
    """Images' vision features by content hash (the next turn of an agent resends the same screenshot): least
    recently used first out beyond *bound* bytes (the last one kept whatever its size). Worker thread only."""

    def __init__(self, evaluate: Callable[[Any], Any], bound: int = FEATURE_CACHE_BYTES) -> None:
        self.evaluate = evaluate
        """Computes a lazy array now (``mx.eval``): what is kept is computed, not a graph."""
        self.bound = bound
        self._kept: OrderedDict[str, Any] = OrderedDict()

    def __iter__(self) -> Iterator[str]:
        return iter(self._kept)

    def get(self, image: PromptImage, compute: Callable[[Any], Any]) -> Any:
        """*image*'s features: kept ones, else ``compute(image.pixels)``, evaluated (an array of ``nbytes``)."""
        rows = self._kept.pop(image.digest, None)
        if rows is None:
            rows = compute(image.pixels)
            self.evaluate(rows)
        self._kept[image.digest] = rows
        while sum(kept.nbytes for kept in self._kept.values()) > self.bound and len(self._kept) > 1:
            self._kept.popitem(last=False)
        return rows


def processor_settings(config: dict[str, Any], directory: Path) -> dict[str, Any] | None:
    """A vision checkpoint's image processor settings (its ``preprocessor_config.json``), or None: its config has
    no ``vision_config`` and ``image_token_id``, or the file is missing or unreadable (it is served as text)."""
    processor = directory / "preprocessor_config.json"
    if not isinstance(config.get("vision_config"), dict) or "image_token_id" not in config or not processor.is_file():
        return None
    try:
        settings = json.loads(processor.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return settings if isinstance(settings, dict) else None


def image_keys(tokens: list[int], images: tuple[PromptImage, ...], image_token_id: int) -> list[int]:
    """*tokens* as the prefix cache keys them: each image's tokens (the *k*-th run of *image_token_id*) become
    numbers no token is (negative) drawn from that image's hash and the place in its run, so two prompts share a
    key only where they share the images too (the tokens alone are the same for any two images of a size)."""
    keyed, run, at = list(tokens), -1, 0
    for index, token in enumerate(tokens):
        if token != image_token_id:
            continue
        if index == 0 or tokens[index - 1] != image_token_id:
            run, at = run + 1, 0
        if run < len(images):
            keyed[index] = -((int(images[run].digest[:12], 16) << 12) + at + 1)
        at += 1
    return keyed


class VisionPrefill(Protocol):
    """A vision model's image prefill (worker thread): its prompt but the last token, images included, into a
    cache."""

    image_token_id: int

    def keys(self, ids: list[int], images: tuple[PromptImage, ...]) -> list[int]:
        """The prompt *ids* as the prefix cache keys it (:func:`image_keys`, and whatever else its cache depends
        on), as many keys as tokens."""
        ...

    def prefill(self, model: Any, ids: list[int], images: tuple[PromptImage, ...], cache: list[Any],
                start: int = 0, step: int | None = None, stop: int | None = None) -> None:
        """*ids* (the prompt but its last token) from *start* (what *cache* holds already) to *stop* (its end),
        its images' features in place of their tokens, into *cache*, at most *step* tokens a forward where the
        model allows (an image's bidirectional masks may ask for more)."""
        ...
