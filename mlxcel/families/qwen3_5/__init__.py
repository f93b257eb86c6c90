"""Qwen 3.5 / 3.6 / 3.8: the gated-delta hybrid, its speculative target and its ``qwen3_5_mtp`` head.

``target.py`` (verify and rollback of the hybrid's recurrent state), ``mtp.py``
(the head, in the checkpoint as ``mtp.*`` tensors or standalone), ``split.py``
(``mlxcel split-mtp``), ``vision.py`` and ``image_size.py`` (a vision checkpoint's
images), ``bundled/`` (the default pairing ``mlxcel serve`` serves with no
``--model``) and ``train_default.py`` (the script that trained it).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._family import Family

if TYPE_CHECKING:
    from ...models.loader import CheckpointInfo

BUNDLED_MODEL = Path(__file__).parent / "bundled" / "qwen35-stdlib-4m"
"""The default pairing (docs/default-model.md): trained here, served when ``mlxcel serve`` names no model."""


class Qwen35(Family):
    # qwen3_5_moe is Qwen 3.6: the same hybrid layers, MoE MLPs (nothing there to roll back).
    model_types = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe")
    mtp = True
    head_type = "qwen3_5_mtp"

    def image_prompt(self, checkpoint: CheckpointInfo) -> Any:
        """A Qwen 3.5 checkpoint with a ``vision_config`` (``Qwen3_5ForConditionalGeneration``): its image
        processor's settings."""
        from ...models.images import processor_settings
        from .image_size import ImageGeometry, Qwen35ImagePrompt

        settings = processor_settings(checkpoint.config, checkpoint.path)
        if settings is None:
            return None
        try:
            size = settings.get("size") or {}
            geometry = ImageGeometry(
                patch=int(settings.get("patch_size", 16)), merge=int(settings.get("merge_size", 2)),
                temporal_patch=int(settings.get("temporal_patch_size", 2)),
                min_pixels=int(settings.get("min_pixels") or size.get("shortest_edge", 65_536)),
                max_pixels=int(settings.get("max_pixels") or size.get("longest_edge", 16_777_216)))
        except (ValueError, TypeError, AttributeError):
            return None
        return Qwen35ImagePrompt(geometry)

    def load_vision(self, checkpoint: CheckpointInfo, model: Any) -> Any:
        from .vision import Qwen35Vision

        prompt = self.image_prompt(checkpoint)
        assert prompt is not None
        return Qwen35Vision(checkpoint.path, checkpoint.config, prompt.geometry)

    def target(self, model: Any) -> Any:
        from .target import Qwen35Target

        return Qwen35Target(model)

    def inspect_drafter(self, target: CheckpointInfo, *, mtp: bool, draft_model: Path | None,
                        head_types: Collection[str]) -> Any:
        from ...models.drafters.loader import inspect_mtp_head
        from . import mtp as head

        return inspect_mtp_head(target, head, mtp=mtp, draft_model=draft_model, head_types=head_types)

    def load_head(self, spec: Any, target: CheckpointInfo, model: Any) -> tuple[Any, Callable[[Any], Any]]:
        import mlx.core as mx

        from ...models.drafters.loader import PREFIX as MTP_PREFIX
        from ...models.drafters.loader import DrafterError, mtp_files, raw_layout, read_config
        from .mtp import Qwen35Drafter, build

        weights: dict[str, Any] = {}
        if spec.standalone:  # the head's own tensors, norms already shifted, under its own config
            config = read_config(spec.path / "config.json")
            for file in sorted(spec.path.glob("*.safetensors")):
                weights.update(mx.load(str(file)))  # type: ignore[arg-type]
            raw = False
        else:
            config = target.config
            for file in mtp_files(spec.path):
                tensors: dict[str, Any] = mx.load(str(file))  # type: ignore[assignment]
                weights.update({k[len(MTP_PREFIX):]: v for k, v in tensors.items() if k.startswith(MTP_PREFIX)})
            raw = raw_layout(target.path)
        try:
            head = build(config, weights, raw_layout=raw)
        except (ValueError, KeyError) as exc:
            raise DrafterError(f"the MTP weights in {spec.path} do not fit {target.name}: {exc}") from exc
        return head, lambda built: Qwen35Drafter(built, model)

    def split_head(self, source: Path, out: Path, config: dict[str, Any], *, block_size: int | None,
                   quantize: tuple[int, int] | None, report: Callable[[str], None]) -> Path:
        from .split import split_qwen

        return split_qwen(source, out, config, block_size=block_size, quantize=quantize, report=report)


FAMILY = Qwen35()
