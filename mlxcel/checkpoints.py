"""A checkpoint opened with its family's hooks: what the server, the CLI, the tests and the benchmarks call.

:mod:`mlxcel.models` holds what every family shares (the protocols, the
checkpoint's and the drafter's checks, loading the weights) and knows no
family; :mod:`mlxcel.families` holds what each family changes, built on
``models``. Each function here finds the family of a checkpoint's
``model_type`` and hands its part down, so that dependencies point one way:
``checkpoints`` -> ``families`` -> ``models``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from .families import family, head_types, mtp_model_types, own_model_types, split_model_types
from .models.drafters.loader import DrafterError, DrafterSpec, finish_drafter
from .models.loader import CheckpointInfo
from .models.loader import inspect_checkpoint as _inspect_checkpoint
from .models.loader import load_checkpoint as _load_checkpoint
from .models.speculative import DraftHead, SpeculativeTarget


def inspect_checkpoint(path: str | Path) -> CheckpointInfo:
    """Check *path* is a servable checkpoint without loading it (JSON and safetensors headers only)."""
    return _inspect_checkpoint(path, own_models=own_model_types())


def load_checkpoint(info: CheckpointInfo, check: Callable[[], None] | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) of *info*, its family's changes made (worker thread; *check* may abandon it)."""
    return _load_checkpoint(info, family(info.model_type), check=check)


def image_prompt(info: CheckpointInfo) -> Any:
    """How *info*'s prompts hold images (:class:`~mlxcel.models.images.ImagePrompt`), or None: it is served as text
    (JSON only)."""
    return family(info.model_type).image_prompt(info)


def load_vision(info: CheckpointInfo, model: Any) -> Any:
    """The vision half of *info* beside its loaded *model* (:class:`~mlxcel.models.images.VisionPrefill`; worker
    thread)."""
    return family(info.model_type).load_vision(info, model)


def speculative_target(model_type: str, model: Any) -> SpeculativeTarget:
    """The family's target adapter around the loaded mlx-lm *model*."""
    served = family(model_type)
    if not served.mtp:
        raise ValueError(f"model_type {model_type!r} has no speculative target adapter")
    return served.target(model)


def inspect_drafter(target: CheckpointInfo, *, mtp: bool, draft_model: Path | None) -> DrafterSpec:
    """Check the drafter (``--mtp``: the target's own head; else *draft_model*) exists and has weights for a
    family mlxcel can run, before the port is bound. Raises :class:`~mlxcel.models.drafters.DrafterError`."""
    served = family(target.model_type)
    if not served.mtp:
        raise DrafterError(f"model_type {target.model_type!r} has no MTP head mlxcel can run "
                           f"(supported: {', '.join(mtp_model_types())})")
    return served.inspect_drafter(target, mtp=mtp, draft_model=draft_model, head_types=head_types())


def load_drafter(spec: DrafterSpec, target: CheckpointInfo, model: Any, quantize: int | None = None) -> DraftHead:
    """The drafter *spec* names for the loaded target *model* (worker thread only); *quantize*: its linear
    layers' bits."""
    head, drafter = family(spec.model_type).load_head(spec, target, model)
    return finish_drafter(head, drafter, quantize)


def split_mtp(source: Path, out: Path, *, block_size: int | None = None, force: bool = False,
              quantize: tuple[int, int] | None = None, report: Callable[[str], None] = print) -> Path:
    """``mlxcel split-mtp``: write *source*'s MTP head to *out* (``config.json``, ``model.safetensors``, the
    tokenizer files). *block_size*: the K the config names (default: the family's); *quantize*: (bits, group
    size) of an affine quantization (GLM only). Raises :class:`~mlxcel.models.drafters.DrafterError` with one
    line for every way this cannot be done."""
    from .models.drafters.split import split_source

    config = split_source(source, out, force=force, splittable=split_model_types())
    return family(str(config["model_type"])).split_head(source, out, config, block_size=block_size,
                                                        quantize=quantize, report=report)


__all__ = ["image_prompt", "inspect_checkpoint", "inspect_drafter", "load_checkpoint", "load_drafter", "load_vision",
           "speculative_target", "split_mtp"]
