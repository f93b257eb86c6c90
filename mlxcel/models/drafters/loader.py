"""Finding and loading a drafter: the target's in-checkpoint head (``--mtp``) or a directory.

:func:`inspect_drafter` runs before the port is bound and reads only JSON and
safetensors headers; :func:`load_drafter` runs on the worker thread.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..speculative import DraftHead

#: Target model types whose MTP head mlxcel can run, and the head's module.
MTP_FAMILIES = {"qwen3_5": "qwen3_5_mtp", "qwen3_5_text": "qwen3_5_mtp"}
PREFIX = "mtp."


class DrafterError(ValueError):
    """The drafter cannot be used; ``str()`` is one line saying why."""


@dataclass(frozen=True, slots=True)
class DrafterSpec:
    """Where the drafter's weights are, and the name the policy reports for it.

    In-checkpoint heads are named ``<target>#mtp`` (the target directory's
    basename and ``#mtp``); a drafter directory by its basename.
    """

    path: Path
    name: str
    in_checkpoint: bool


def _headers(directory: Path) -> dict[Path, dict[str, Any]]:
    headers = {}
    for file in sorted(directory.glob("*.safetensors")):
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        headers[file] = header
    return headers


def _mtp_files(directory: Path) -> list[Path]:
    return [file for file, header in _headers(directory).items() if any(k.startswith(PREFIX) for k in header)]


def _raw_layout(target: Path) -> bool:
    """Whether *target* is in the raw Hugging Face layout (zero-centred norms), as mlx-lm decides it:
    a gated-delta ``conv1d`` weight stored as (channels, 1, kernel) rather than (channels, kernel, 1).
    A target without gated-delta layers gets no shift from mlx-lm, so its head gets none either."""
    for header in _headers(target).values():
        for name, tensor in header.items():
            if "conv1d.weight" in name:
                return bool(tensor["shape"][-1] != 1)
    return False  # no gated-delta layers: mlx-lm applies no norm shift, and neither do we


def inspect_drafter(target: Path, model_type: str, *, mtp: bool, draft_model: Path | None) -> DrafterSpec:
    """Check the drafter exists and has MTP weights for a family mlxcel can run."""
    if model_type not in MTP_FAMILIES:
        raise DrafterError(f"model_type {model_type!r} has no MTP head mlxcel can run "
                           f"(supported: {', '.join(sorted(MTP_FAMILIES))})")
    if draft_model is not None:
        directory = draft_model.expanduser()
        if not directory.is_dir():
            raise DrafterError(f"draft model directory {directory} does not exist")
        spec = DrafterSpec(path=directory, name=directory.resolve().name, in_checkpoint=False)
    else:
        assert mtp
        spec = DrafterSpec(path=target, name=f"{target.resolve().name}#mtp", in_checkpoint=True)
    try:
        files = _mtp_files(spec.path)
    except (OSError, ValueError, struct.error) as exc:
        raise DrafterError(f"cannot read the safetensors in {spec.path}: {exc}") from exc
    if not files:
        raise DrafterError(f"{spec.path} has no MTP weights (no {PREFIX}* tensors)")
    keys = [k for f in files for k in _headers(spec.path)[f] if k.startswith(PREFIX)]
    if any(".experts." in k for k in keys):
        raise DrafterError(f"{spec.path} has a mixture-of-experts MTP head, which mlxcel does not run yet")
    return spec


def load_drafter(spec: DrafterSpec, target: Path, model: Any) -> DraftHead:
    """The drafter for the loaded target *model* (worker thread only)."""
    import mlx.core as mx

    from . import qwen3_5_mtp

    config = json.loads((target / "config.json").read_text(encoding="utf-8"))
    weights: dict[str, Any] = {}
    for file in _mtp_files(spec.path):
        tensors: dict[str, Any] = mx.load(str(file))  # type: ignore[assignment]
        weights.update({k[len(PREFIX):]: v for k, v in tensors.items() if k.startswith(PREFIX)})
    try:
        head = qwen3_5_mtp.build(config, weights, raw_layout=_raw_layout(target))
    except (ValueError, KeyError) as exc:
        raise DrafterError(f"the MTP weights in {spec.path} do not fit {target.name}: {exc}") from exc
    mx.eval(head.parameters())
    return qwen3_5_mtp.Qwen35Drafter(head, model)
