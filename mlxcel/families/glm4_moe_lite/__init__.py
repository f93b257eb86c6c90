"""GLM-4.7-Flash: MLA attention and MoE over plain KV caches, its target and its next-token layer.

``target.py`` (verify and rollback), ``mtp.py`` (the next-token layer as a
drafter, ``glm4_moe_lite_mtp``), ``split.py`` (``mlxcel split-mtp``: the layer
streamed out of the raw checkpoint). The layer is served only from its own
directory, never from inside the target.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._family import Family

if TYPE_CHECKING:
    from ...models.loader import CheckpointInfo


class Glm4MoeLite(Family):
    model_types = ("glm4_moe_lite",)
    mtp = True
    head_type = "glm4_moe_lite_mtp"

    def prepare(self, model: Any) -> None:
        from .target import prepare

        prepare(model)

    def target(self, model: Any) -> Any:
        from .target import Glm4MoeLiteTarget

        return Glm4MoeLiteTarget(model)

    def inspect_drafter(self, target: CheckpointInfo, *, mtp: bool, draft_model: Path | None,
                        head_types: Collection[str]) -> Any:
        from ...models.drafters.loader import inspect_mtp_head
        from . import mtp as head

        return inspect_mtp_head(target, head, mtp=mtp, draft_model=draft_model, head_types=head_types,
                                split_only=True)

    def load_head(self, spec: Any, target: CheckpointInfo, model: Any) -> tuple[Any, Callable[[Any], Any]]:
        from ...models.drafters.loader import DrafterError
        from .mtp import Glm4MoeLiteDrafter, load

        try:
            head = load(spec.path)
        except (ValueError, KeyError) as exc:
            raise DrafterError(f"the next-token layer in {spec.path} cannot be loaded: {exc}") from exc
        return head, Glm4MoeLiteDrafter

    def split_head(self, source: Path, out: Path, config: dict[str, Any], *, block_size: int | None,
                   quantize: tuple[int, int] | None, report: Callable[[str], None]) -> Path:
        from ...models.drafters.split import copy_tokenizer
        from .mtp import STANDALONE_TYPE
        from .split import split_glm

        (out / "model.safetensors.index.json").unlink(missing_ok=True)  # a stale index would name other shards
        written, block = split_glm(source, out, config, block_size=block_size, quantize=quantize, report=report)
        copy_tokenizer(source, out)
        if not (out / "tokenizer.json").is_file() and not (out / "tokenizer.model").is_file():
            report(f"warning: {source} has no tokenizer file; {out} has none either")
        bits = "" if quantize is None else f", {quantize[0]}-bit group {quantize[1]}"
        report(f"wrote {written} tensors to {out} (model_type {STANDALONE_TYPE}, block_size {block}{bits})")
        return out


FAMILY = Glm4MoeLite()
