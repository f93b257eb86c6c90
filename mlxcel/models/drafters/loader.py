"""Finding and loading a drafter: the target's in-checkpoint head (``--mtp``) or a directory.

What is common to every family's drafter: the spec, the checks on safetensors
headers and standalone heads, quantization. The family of the target's
``model_type`` (:mod:`mlxcel.families`) decides the rest, and
:mod:`mlxcel.checkpoints` picks it: its ``inspect_drafter`` runs before the
port is bound and reads only JSON and safetensors headers; its
``load_drafter`` runs on the worker thread and ends in :func:`finish_drafter`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..loader import CheckpointInfo
    from ..speculative import DraftHead

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
    model_type: str
    """The target's ``model_type``: its family loads the head."""
    standalone: bool = False
    """A standalone directory (``mlxcel split-mtp``): the head's own tensors and config."""
    block_size: int | None = None
    """The K the drafter's config names, if any (the default when neither flag nor environment does)."""

    def own_bytes(self) -> int:
        """The bytes of weights it adds to the target's: its directory's safetensors, none for an in-checkpoint
        head (the target's own files hold it)."""
        if self.in_checkpoint:
            return 0
        return sum(f.stat().st_size for f in self.path.glob("*.safetensors"))


def block_size_of(value: Any) -> int | None:
    """A config's ``block_size``, when it is one mlxcel can run (2 to 32)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 2 <= value <= 32 else None


def read_config(path: Path) -> dict[str, Any]:
    """*path* (a ``config.json``) as a JSON object; :class:`DrafterError` with one line if it is not one."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DrafterError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise DrafterError(f"{path} is not a JSON object")
    return config


def headers(directory: Path) -> dict[Path, dict[str, tuple[int, ...]]]:
    """Each safetensors file of *directory*, with its tensors' shapes by name, read from the headers
    (``safetensors.safe_open``; no tensor is read). A file that is not safetensors raises ``ValueError``."""
    from safetensors import SafetensorError, safe_open

    found = {}
    for file in sorted(directory.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="numpy") as tensors:
                found[file] = {name: tuple(tensors.get_slice(name).get_shape()) for name in tensors.keys()}  # noqa: SIM118
        except SafetensorError as exc:
            raise ValueError(f"{file.name}: {exc}") from exc
    return found


def mtp_files(directory: Path) -> list[Path]:
    """The safetensors files of *directory* that hold ``mtp.*`` tensors."""
    return [file for file, header in headers(directory).items() if any(k.startswith(PREFIX) for k in header)]


def raw_layout(target: Path) -> bool:
    """Whether *target* is in the raw Hugging Face layout (zero-centred norms), as mlx-lm decides it:
    a gated-delta ``conv1d`` weight stored as (channels, 1, kernel) rather than (channels, kernel, 1).
    A target without gated-delta layers gets no shift from mlx-lm, so its head gets none either."""
    for header in headers(target).values():
        for name, shape in header.items():
            if "conv1d.weight" in name:
                return bool(shape[-1] != 1)
    return False  # no gated-delta layers: mlx-lm applies no norm shift, and neither do we


def drafter_directory(draft_model: Path) -> Path:
    directory = draft_model.expanduser()
    if not directory.is_dir():
        raise DrafterError(f"draft model directory {directory} does not exist")
    return directory


def inspect_mtp_head(target: CheckpointInfo, head: Any, *, mtp: bool, draft_model: Path | None,
                     head_types: Collection[str], split_only: bool = False) -> DrafterSpec:
    """A head of ``mtp.*`` tensors (in the target, ``--mtp``, or a checkpoint directory) or a standalone
    one (``mlxcel split-mtp``). *head*: the head's module (``STANDALONE_TYPE``, ``inventory``,
    ``text_config``); *head_types*: every drafter kind a family runs (a directory of another is refused by
    name); *split_only*: served only from a standalone directory, never from inside the target."""
    head_type, model_type = head.STANDALONE_TYPE, target.model_type
    if draft_model is None and split_only:
        raise DrafterError(f"a {model_type} target's next-token layer is served from its own directory: "
                           f"`mlxcel split-mtp -m RAW_DIR -o OUT_DIR`, then --draft-model OUT_DIR")
    if draft_model is not None:
        directory = drafter_directory(draft_model)
        standalone = _standalone_config(directory, head_type, head_types, split_only)
        if standalone is not None:
            return _inspect_standalone(directory, standalone, target, head)
        spec = DrafterSpec(path=directory, name=directory.resolve().name, in_checkpoint=False, model_type=model_type)
    else:
        assert mtp
        spec = DrafterSpec(path=target.path, name=f"{target.name}#mtp", in_checkpoint=True,
                           model_type=model_type)
    try:
        files = mtp_files(spec.path)
    except (OSError, ValueError) as exc:
        raise DrafterError(f"cannot read the safetensors in {spec.path}: {exc}") from exc
    if not files:
        raise DrafterError(f"{spec.path} has no MTP weights (no {PREFIX}* tensors)")
    return spec


def _standalone_config(directory: Path, head_type: str, head_types: Collection[str],
                       split_only: bool) -> dict[str, Any] | None:
    """A drafter directory's config, if it is a standalone *head_type* head; a clear error if it is something else."""
    path = directory / "config.json"
    if not path.is_file():
        return None  # safetensors holding mtp.* tensors, beside nothing else
    config = read_config(path)
    model_type = config.get("model_type")
    if model_type == head_type:
        return config
    if model_type in head_types:
        raise DrafterError(f"{directory} is a {model_type} head; this target needs a {head_type} one")
    if split_only:
        raise DrafterError(f"{directory} does not look like a standalone {head_type} head: its config.json "
                           f"says model_type {model_type!r} (make one with `mlxcel split-mtp`)")
    if any(k.startswith(PREFIX) for header in headers(directory).values() for k in header):
        return None  # a full checkpoint with its head inside: its mtp.* tensors are used
    raise DrafterError(f"{directory} does not look like a standalone {head_type} head: its config.json "
                       f"says model_type {model_type!r} and it holds no {PREFIX}* tensors "
                       "(make one with `mlxcel split-mtp`)")


def _inspect_standalone(directory: Path, config: dict[str, Any], target: CheckpointInfo, head: Any) -> DrafterSpec:
    """Strict inventory: exactly the tensors (names and shapes) a head of this config holds."""
    STANDALONE_TYPE, inventory, text_config = head.STANDALONE_TYPE, head.inventory, head.text_config
    try:
        found = {name: shape for header in headers(directory).values() for name, shape in header.items()}
    except (OSError, ValueError) as exc:
        raise DrafterError(f"cannot read the safetensors in {directory}: {exc}") from exc
    try:
        expected = inventory(config)
    except (TypeError, ValueError, KeyError) as exc:
        raise DrafterError(f"{directory / 'config.json'} is not a usable {STANDALONE_TYPE} config: {exc}") from exc
    if found != expected:
        unknown, missing = sorted(set(found) - set(expected)), sorted(set(expected) - set(found))
        misshapen = sorted(n for n in set(found) & set(expected) if found[n] != expected[n])
        what = "; ".join(f"{label}: {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
                         for label, names in (("unexpected", unknown), ("missing", missing),
                                              ("wrong shape", misshapen)) if names)
        raise DrafterError(f"{directory} does not look like a standalone {STANDALONE_TYPE} head "
                           f"({len(found)} tensors; {what})")
    target_text = text_config(target.config)
    for key in ("hidden_size", "vocab_size"):
        if text_config(config).get(key) != target_text.get(key):
            raise DrafterError(f"the head in {directory} was split from another model: {key} "
                               f"{text_config(config).get(key)} != the target's {target_text.get(key)}")
    return DrafterSpec(path=directory, name=directory.resolve().name, in_checkpoint=False, model_type=target.model_type,
                       standalone=True, block_size=block_size_of(config.get("block_size")))


def finish_drafter(head: Any, drafter: Callable[[Any], DraftHead], quantize: int | None = None) -> DraftHead:
    """The drafter *drafter* makes of the loaded *head* (an ``nn.Module``, evaluated here; worker thread
    only); *quantize*: its linear layers' bits first (affine, group 64; layers whose width does not divide
    are kept as they are)."""
    import mlx.core as mx

    from ..turned_weights import turn

    if quantize is not None:
        _quantize(head, quantize)
    mx.eval(head.parameters())
    turn(head)  # its float layers, as the target's (a weight it shares with the target is not copied again)
    return drafter(head)


def _quantize(head: Any, bits: int) -> None:
    """--draft-quantize: the head's float linear layers, affine, group 64 (those whose width divides)."""
    import mlx.nn as nn

    nn.quantize(head, group_size=64, bits=bits,
                class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % 64 == 0)
