"""Finding and loading a drafter: the target's in-checkpoint head (``--mtp``) or a directory.

:func:`inspect_drafter` runs before the port is bound and reads only JSON and
safetensors headers; :func:`load_drafter` runs on the worker thread.
"""

from __future__ import annotations

import importlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..speculative import DraftHead

#: Target model types whose MTP head mlxcel can run, and the head's module.
MTP_FAMILIES = {"qwen3_5": "qwen3_5_mtp", "qwen3_5_text": "qwen3_5_mtp", "qwen3_5_moe": "qwen3_5_mtp",
                "gemma4": "gemma4_assistant", "gemma4_text": "gemma4_assistant",
                "glm4_moe_lite": "glm4_moe_lite_mtp",
                "inkling_mm_model": "inkling_mtp", "inkling_text": "inkling_mtp"}
#: Heads served only from a standalone directory (``mlxcel split-mtp``), never from inside the target.
SPLIT_ONLY = {"glm4_moe_lite_mtp"}
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
    standalone: bool = False
    """A standalone directory (``mlxcel split-mtp``): the head's own tensors and config."""
    block_size: int | None = None
    """The K the drafter's config names, if any (the default when neither flag nor environment does)."""
    family: str = "qwen3_5_mtp"
    """The drafter's kind: the module under ``models/drafters/`` that runs it."""


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
    head_type = MTP_FAMILIES[model_type]
    if head_type == "gemma4_assistant":
        return _inspect_assistant(target, mtp=mtp, draft_model=draft_model)
    if head_type == "inkling_mtp":
        return _inspect_inkling(target, draft_model)
    if draft_model is None and head_type in SPLIT_ONLY:
        raise DrafterError(f"a {model_type} target's next-token layer is served from its own directory: "
                           f"`mlxcel split-mtp -m RAW_DIR -o OUT_DIR`, then --draft-model OUT_DIR")
    if draft_model is not None:
        directory = draft_model.expanduser()
        if not directory.is_dir():
            raise DrafterError(f"draft model directory {directory} does not exist")
        standalone = _standalone_config(directory, head_type)
        if standalone is not None:
            return _inspect_standalone(directory, standalone, target, _head_module(head_type))
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
    return spec


def _head_module(head_type: str) -> Any:
    return importlib.import_module(f"{__package__}.{head_type}")


def _standalone_config(directory: Path, head_type: str) -> dict[str, Any] | None:
    """A drafter directory's config, if it is a standalone *head_type* head; a clear error if it is something else."""
    path = directory / "config.json"
    if not path.is_file():
        return None  # safetensors holding mtp.* tensors, beside nothing else
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DrafterError(f"{path} is not valid JSON: {exc}") from exc
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type == head_type:
        return config  # type: ignore[no-any-return]
    if model_type in MTP_FAMILIES.values():
        raise DrafterError(f"{directory} is a {model_type} head; this target needs a {head_type} one")
    if head_type in SPLIT_ONLY:
        raise DrafterError(f"{directory} does not look like a standalone {head_type} head: its config.json "
                           f"says model_type {model_type!r} (make one with `mlxcel split-mtp`)")
    if any(k.startswith(PREFIX) for header in _headers(directory).values() for k in header):
        return None  # a full checkpoint with its head inside: its mtp.* tensors are used
    raise DrafterError(f"{directory} does not look like a standalone {head_type} head: its config.json "
                       f"says model_type {model_type!r} and it holds no {PREFIX}* tensors "
                       "(make one with `mlxcel split-mtp`)")


def _inspect_standalone(directory: Path, config: dict[str, Any], target: Path, head: Any) -> DrafterSpec:
    """Strict inventory: exactly the tensors (names and shapes) a head of this config holds.
    *head*: the head's module (``STANDALONE_TYPE``, ``inventory``, ``text_config``)."""
    STANDALONE_TYPE, inventory, text_config = head.STANDALONE_TYPE, head.inventory, head.text_config
    try:
        found = {name: tuple(t["shape"]) for header in _headers(directory).values() for name, t in header.items()}
    except (OSError, ValueError, struct.error) as exc:
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
    target_text = text_config(json.loads((target / "config.json").read_text(encoding="utf-8")))
    for key in ("hidden_size", "vocab_size"):
        if text_config(config).get(key) != target_text.get(key):
            raise DrafterError(f"the head in {directory} was split from another model: {key} "
                               f"{text_config(config).get(key)} != the target's {target_text.get(key)}")
    block_size = config.get("block_size")
    return DrafterSpec(path=directory, name=directory.resolve().name, in_checkpoint=False, standalone=True,
                       block_size=block_size if isinstance(block_size, int) and 2 <= block_size <= 32 else None)


def _inspect_assistant(target: Path, *, mtp: bool, draft_model: Path | None) -> DrafterSpec:
    """A Gemma 4 target's drafter: an assistant checkpoint directory, never the target itself."""
    from .gemma4_assistant import TYPES

    if draft_model is None:
        raise DrafterError("Gemma 4 checkpoints carry no MTP head: give its assistant with --draft-model DIR "
                           f"(a {' or '.join(TYPES)} checkpoint)")
    directory = draft_model.expanduser()
    if not directory.is_dir():
        raise DrafterError(f"draft model directory {directory} does not exist")
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DrafterError(f"{directory} has no readable config.json: {exc}") from exc
    kind = config.get("model_type") if isinstance(config, dict) else None
    if kind not in TYPES:
        raise DrafterError(f"{directory} is not a Gemma 4 assistant: its config.json says model_type {kind!r} "
                           f"(expected {' or '.join(TYPES)})")
    target_config = json.loads((target / "config.json").read_text(encoding="utf-8"))
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
        if not any(_headers(directory).values()):
            raise DrafterError(f"{directory} holds no safetensors weights")
    except (OSError, ValueError, struct.error) as exc:
        raise DrafterError(f"cannot read the safetensors in {directory}: {exc}") from exc
    block_size = config.get("block_size", 4)
    return DrafterSpec(path=directory, name=directory.resolve().name, in_checkpoint=False,
                       block_size=block_size if isinstance(block_size, int) and 2 <= block_size <= 32 else None,
                       family="gemma4_assistant")


def _inspect_inkling(target: Path, draft_model: Path | None) -> DrafterSpec:
    """Inkling's head: the unindexed ``mtp.safetensors`` of the target (``--mtp``) or of the
    ``--draft-model`` directory (a full checkpoint: only that file is read)."""
    from .inkling_mtp import FILE
    from .inkling_mtp import PREFIX as INKLING_PREFIX

    directory = (draft_model or target).expanduser()
    if not directory.is_dir():
        raise DrafterError(f"draft model directory {directory} does not exist")
    file = directory / FILE
    if not file.is_file():
        raise DrafterError(f"{directory} has no {FILE} (Inkling's MTP head)")
    try:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            names = set(json.loads(f.read(length))) - {"__metadata__"}
    except (OSError, ValueError, struct.error) as exc:
        raise DrafterError(f"cannot read {file}: {exc}") from exc
    if not any(n.startswith(INKLING_PREFIX) for n in names):
        raise DrafterError(f"{file} holds no {INKLING_PREFIX}* tensors")
    config = json.loads((target / "config.json").read_text(encoding="utf-8"))
    blocks = len({n[len(INKLING_PREFIX):].split(".")[0] for n in names if n.startswith(INKLING_PREFIX)})
    block_size = config.get("block_size") or (config.get("mtp_config") or {}).get("block_size") or blocks + 2
    name = f"{target.resolve().name}#mtp" if draft_model is None else directory.resolve().name
    return DrafterSpec(path=file, name=name, in_checkpoint=draft_model is None,
                       block_size=block_size if isinstance(block_size, int) and 2 <= block_size <= 32 else None,
                       family="inkling_mtp")


def load_drafter(spec: DrafterSpec, target: Path, model: Any, quantize: int | None = None) -> DraftHead:
    """The drafter for the loaded target *model* (worker thread only); *quantize*: its linear layers'
    bits (affine, group 64; layers whose width does not divide are kept as they are)."""
    import mlx.core as mx

    from . import qwen3_5_mtp

    if spec.family == "gemma4_assistant":
        from . import gemma4_assistant

        try:
            assistant = gemma4_assistant.build(spec.path)
            if quantize is not None:
                _quantize(assistant, quantize)
            mx.eval(assistant.parameters())
            return gemma4_assistant.Gemma4AssistantDrafter(assistant, model)
        except (ValueError, KeyError) as exc:
            raise DrafterError(f"the assistant in {spec.path} does not fit {target.name}: {exc}") from exc

    if spec.family == "inkling_mtp":
        from . import inkling_mtp

        config = json.loads((target / "config.json").read_text(encoding="utf-8"))
        try:
            inkling_head = inkling_mtp.build(config, mx.load(str(spec.path)))  # type: ignore[arg-type]
        except (ValueError, KeyError) as exc:
            raise DrafterError(f"the MTP weights in {spec.path} do not fit {target.name}: {exc}") from exc
        if quantize is not None:
            _quantize(inkling_head, quantize)
        mx.eval(inkling_head.parameters())
        return inkling_mtp.InklingDrafter(inkling_head, model)

    weights: dict[str, Any] = {}
    if spec.standalone and _standalone_type(spec.path) == "glm4_moe_lite_mtp":
        from . import glm4_moe_lite_mtp

        try:
            glm_head = glm4_moe_lite_mtp.load(spec.path)
        except (ValueError, KeyError) as exc:
            raise DrafterError(f"the next-token layer in {spec.path} cannot be loaded: {exc}") from exc
        if quantize is not None:
            _quantize(glm_head, quantize)
        mx.eval(glm_head.parameters())
        return glm4_moe_lite_mtp.Glm4MoeLiteDrafter(glm_head)
    if spec.standalone:  # the head's own tensors, norms already shifted, under its own config
        config = json.loads((spec.path / "config.json").read_text(encoding="utf-8"))
        for file in sorted(spec.path.glob("*.safetensors")):
            weights.update(mx.load(str(file)))  # type: ignore[arg-type]
        raw = False
    else:
        config = json.loads((target / "config.json").read_text(encoding="utf-8"))
        for file in _mtp_files(spec.path):
            tensors: dict[str, Any] = mx.load(str(file))  # type: ignore[assignment]
            weights.update({k[len(PREFIX):]: v for k, v in tensors.items() if k.startswith(PREFIX)})
        raw = _raw_layout(target)
    try:
        head = qwen3_5_mtp.build(config, weights, raw_layout=raw)
    except (ValueError, KeyError) as exc:
        raise DrafterError(f"the MTP weights in {spec.path} do not fit {target.name}: {exc}") from exc
    if quantize is not None:
        _quantize(head, quantize)
    mx.eval(head.parameters())
    return qwen3_5_mtp.Qwen35Drafter(head, model)


def _quantize(head: Any, bits: int) -> None:
    """--draft-quantize: the head's float linear layers, affine, group 64 (those whose width divides)."""
    import mlx.nn as nn

    nn.quantize(head, group_size=64, bits=bits,
                class_predicate=lambda _, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % 64 == 0)


def _standalone_type(directory: Path) -> Any:
    return json.loads((directory / "config.json").read_text(encoding="utf-8")).get("model_type")
