"""What a model family is: :class:`Family`, whose hooks a family overrides where it changes mlx-lm.

A module of its own, so that a family's module imports it without importing
the package that finds the families (:mod:`mlxcel.families`, which imports
them). No mlx at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Collection
    from pathlib import Path

    from ..models.drafters import DrafterSpec
    from ..models.images import ImagePrompt, VisionPrefill
    from ..models.loader import CheckpointInfo
    from ..models.speculative import DraftHead, SpeculativeTarget


class Family:
    """A plain mlx-lm family: what every hook does unless a family overrides it."""

    model_types: tuple[str, ...] = ()
    """The ``model_type`` values (``config.json``) this family serves."""
    own_model: bool = False
    """mlxcel carries the model file (mlx-lm has none): :meth:`model_classes` builds it."""
    mtp: bool = False
    """The family has a speculative target and a drafter kind (:meth:`target`, :meth:`inspect_drafter`)."""
    head_type: str | None = None
    """Its drafter's kind, as a standalone head's ``config.json`` names it (``model_type``)."""

    def config_overrides(self, config: dict[str, Any]) -> dict[str, Any]:
        """Config values mlx-lm must be given on top of the checkpoint's ``config.json``."""
        return {}

    def prepare(self, model: Any) -> None:
        """Change the loaded model in place before anything runs on it."""

    def adopt_cache(self, cache: list[Any]) -> list[Any]:
        """*cache* (a sequence's, from mlx-lm's batch or the prefix cache) in the family's own cache classes."""
        return cache

    def cache_classes(self) -> tuple[type, ...]:
        """The family's own cache classes (beside mlx-lm's), which a prompt cache file may name: each
        rebuilds itself with ``from_state``."""
        return ()

    def image_prompt(self, checkpoint: CheckpointInfo) -> ImagePrompt | None:
        """How *checkpoint*'s prompts hold images, when it is a vision model this family serves with its images
        (reads JSON only); None: its text half alone."""
        return None

    def load_vision(self, checkpoint: CheckpointInfo, model: Any) -> VisionPrefill:
        """The vision half of *checkpoint* beside its loaded text *model* (worker thread; :meth:`image_prompt`
        said it is a vision model)."""
        raise NotImplementedError

    def model_classes(self, config: dict[str, Any]) -> tuple[Any, Any]:
        """(Model, ModelArgs) of an own model file: mlx-lm's ``load_model(get_model_classes=...)``."""
        raise NotImplementedError(f"model_type {config.get('model_type')!r} is mlx-lm's own")

    def target(self, model: Any) -> SpeculativeTarget:
        """The speculative target adapter around the loaded model (worker thread; :attr:`mtp` families only)."""
        raise NotImplementedError

    def inspect_drafter(self, target: CheckpointInfo, *, mtp: bool, draft_model: Path | None,
                        head_types: Collection[str]) -> DrafterSpec:
        """Check the drafter (``--mtp``: the target's own head; else *draft_model*) before the port is bound;
        reads only JSON and safetensors headers. *head_types*: every drafter kind a family runs (a directory
        holding another is refused by name). Raises :class:`~mlxcel.models.drafters.DrafterError`
        (:attr:`mtp` families only)."""
        raise NotImplementedError

    def load_head(self, spec: DrafterSpec, target: CheckpointInfo,
                  model: Any) -> tuple[Any, Callable[[Any], DraftHead]]:
        """The head *spec* names (an ``nn.Module``, not yet evaluated: it may be quantized first) and what
        makes the drafter of the loaded target *model* from it (worker thread)."""
        raise NotImplementedError

    def split_head(self, source: Path, out: Path, config: dict[str, Any], *, block_size: int | None,
                   quantize: tuple[int, int] | None, report: Callable[[str], None]) -> Path:
        """``mlxcel split-mtp``: write the raw checkpoint *source*'s head to *out* as a standalone drafter (a
        family that overrides it; :func:`split_model_types` lists them)."""
        raise NotImplementedError
