"""Gemma 4 and its assistant: sliding-window caches, the speculative target, the assistant as drafter.

``target.py`` (the family's load hooks: config overrides, the sliding-window
ring cache, cache adoption; verify and rollback), ``assistant.py`` (the
assistant checkpoint, which attends into the target's cache).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._family import Family

if TYPE_CHECKING:
    from ...models.loader import CheckpointInfo


class Gemma4(Family):
    model_types = ("gemma4", "gemma4_text")
    mtp = True
    head_type = "gemma4_assistant"

    def config_overrides(self, config: dict[str, Any]) -> dict[str, Any]:
        from .target import config_overrides

        return config_overrides(config)

    def prepare(self, model: Any) -> None:
        from .target import prepare

        prepare(model)

    def adopt_cache(self, cache: list[Any]) -> list[Any]:
        from .target import adopt_cache

        return adopt_cache(cache)

    def image_prompt(self, checkpoint: CheckpointInfo) -> Any:
        """A Gemma 4 checkpoint with a ``vision_config``, its image processor's settings and its image token id."""
        from ...models.images import processor_settings
        from .image_size import Gemma4ImagePrompt, ImageGeometry

        settings = processor_settings(checkpoint.config, checkpoint.path)
        if settings is None:
            return None
        try:
            geometry = ImageGeometry(int(settings.get("patch_size", 16)), int(settings.get("pooling_kernel_size", 3)),
                                     int(settings.get("max_soft_tokens", 280)))
        except (ValueError, TypeError):
            return None
        return Gemma4ImagePrompt(geometry)

    def load_vision(self, checkpoint: CheckpointInfo, model: Any) -> Any:
        from .vision import Gemma4Vision

        prompt = self.image_prompt(checkpoint)
        assert prompt is not None
        return Gemma4Vision(checkpoint.path, checkpoint.config, prompt.geometry)

    def cache_classes(self) -> tuple[type, ...]:
        from .target import SlidingWindowCache

        return (SlidingWindowCache,)

    def target(self, model: Any) -> Any:
        from .target import Gemma4Target

        return Gemma4Target(model)

    def inspect_drafter(self, target: CheckpointInfo, *, mtp: bool, draft_model: Path | None,
                        head_types: Collection[str]) -> Any:
        """An assistant checkpoint directory, never the target itself."""
        from ...models.drafters.loader import (
            DrafterError,
            DrafterSpec,
            block_size_of,
            drafter_directory,
            headers,
        )
        from .assistant import TYPES

        if draft_model is None:
            raise DrafterError("Gemma 4 checkpoints carry no MTP head: give its assistant with --draft-model DIR "
                               f"(a {' or '.join(TYPES)} checkpoint)")
        directory = drafter_directory(draft_model)
        try:
            config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise DrafterError(f"{directory} has no readable config.json: {exc}") from exc
        kind = config.get("model_type") if isinstance(config, dict) else None
        if kind not in TYPES:
            raise DrafterError(f"{directory} is not a Gemma 4 assistant: its config.json says model_type "
                               f"{kind!r} (expected {' or '.join(TYPES)})")
        target_config = target.config
        text = target_config.get("text_config", target_config)
        backbone = config.get("backbone_hidden_size")
        if backbone != text.get("hidden_size"):
            raise DrafterError(f"the assistant in {directory} was trained for a {backbone}-wide target; "
                               f"{target.name} is {text.get('hidden_size')} wide")
        vocab = (config.get("text_config") or {}).get("vocab_size")
        if vocab != text.get("vocab_size"):
            raise DrafterError(f"the assistant in {directory} has a vocabulary of {vocab}; {target.name} has "
                               f"{text.get('vocab_size')}")
        try:
            if not any(headers(directory).values()):
                raise DrafterError(f"{directory} holds no safetensors weights")
        except (OSError, ValueError) as exc:
            raise DrafterError(f"cannot read the safetensors in {directory}: {exc}") from exc
        return DrafterSpec(path=directory, name=directory.resolve().name, in_checkpoint=False,
                           model_type=target.model_type, block_size=block_size_of(config.get("block_size", 4)))

    def load_head(self, spec: Any, target: CheckpointInfo, model: Any) -> tuple[Any, Callable[[Any], Any]]:
        from ...models.drafters.loader import DrafterError
        from .assistant import Gemma4AssistantDrafter, build

        try:
            assistant = build(spec.path)
        except (ValueError, KeyError) as exc:
            raise DrafterError(f"the assistant in {spec.path} does not fit {target.name}: {exc}") from exc
        return assistant, lambda built: Gemma4AssistantDrafter(built, model)


FAMILY = Gemma4()
