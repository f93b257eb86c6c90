"""Inkling: mlxcel's own model file (mlx-lm has none), its speculative target and its ``mtp.safetensors`` head.

``model.py`` (ModelArgs, sanitize of the raw names, its caches), ``target.py``
(verify and rollback across the convolution states), ``mtp.py`` (the head).
Served one sequence at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._family import Family

if TYPE_CHECKING:
    from ...models.loader import CheckpointInfo


class Inkling(Family):
    model_types = ("inkling_mm_model", "inkling_text")
    own_model = True
    mtp = True
    head_type = "inkling_mtp"

    def model_classes(self, config: dict[str, Any]) -> tuple[Any, Any]:
        from .model import Model, ModelArgs

        return Model, ModelArgs

    def cache_classes(self) -> tuple[type, ...]:
        from .model import InklingCache

        return (InklingCache,)

    def target(self, model: Any) -> Any:
        from .target import InklingTarget

        return InklingTarget(model)

    def inspect_drafter(self, target: CheckpointInfo, *, mtp: bool, draft_model: Path | None,
                        head_types: Collection[str]) -> Any:
        """The unindexed ``mtp.safetensors`` of the target (``--mtp``) or of the ``--draft-model``
        directory (a full checkpoint: only that file is read)."""
        from safetensors import SafetensorError, safe_open

        from ...models.drafters.loader import DrafterError, DrafterSpec, block_size_of
        from .mtp import FILE, PREFIX

        directory = (draft_model or target.path).expanduser()
        if not directory.is_dir():
            raise DrafterError(f"draft model directory {directory} does not exist")
        file = directory / FILE
        if not file.is_file():
            raise DrafterError(f"{directory} has no {FILE} (Inkling's MTP head)")
        try:
            with safe_open(str(file), framework="numpy") as tensors:
                names = set(tensors.keys())
        except (OSError, SafetensorError) as exc:
            raise DrafterError(f"cannot read {file}: {exc}") from exc
        if not any(n.startswith(PREFIX) for n in names):
            raise DrafterError(f"{file} holds no {PREFIX}* tensors")
        config = target.config
        blocks = len({n[len(PREFIX):].split(".")[0] for n in names if n.startswith(PREFIX)})
        block_size = config.get("block_size") or (config.get("mtp_config") or {}).get("block_size") or blocks + 2
        name = f"{target.name}#mtp" if draft_model is None else directory.resolve().name
        return DrafterSpec(path=file, name=name, in_checkpoint=draft_model is None, model_type=target.model_type,
                           block_size=block_size_of(block_size))

    def load_head(self, spec: Any, target: CheckpointInfo, model: Any) -> tuple[Any, Callable[[Any], Any]]:
        import mlx.core as mx

        from ...models.drafters.loader import DrafterError
        from .mtp import InklingDrafter, build

        config = target.config
        try:
            head = build(config, mx.load(str(spec.path)))  # type: ignore[arg-type]
        except (ValueError, KeyError) as exc:
            raise DrafterError(f"the MTP weights in {spec.path} do not fit {target.name}: {exc}") from exc
        return head, lambda built: InklingDrafter(built, model)


FAMILY = Inkling()
