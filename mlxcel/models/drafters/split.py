"""``mlxcel split-mtp``: a raw checkpoint's MTP head, written out as a standalone drafter directory.

Quantized and community conversions of a target drop its MTP tensors (mlx-lm's
loader does not keep them), so the head has to come from the raw checkpoint,
once, into a directory that ``--draft-model`` serves beside any conversion of
the same target. Reads only the shards that hold the head (through the
checkpoint's ``model.safetensors.index.json`` when it has one). The checks
every family shares are here (:func:`split_source`); the family of the
checkpoint's ``model_type`` writes its head (``Family.split_head``), which
:func:`mlxcel.checkpoints.split_mtp` calls.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Collection
from pathlib import Path
from typing import Any

from .loader import PREFIX, DrafterError, headers

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "chat_template.jinja", "generation_config.json")


def head_files(source: Path) -> list[Path]:
    """The safetensors files that hold ``mtp.*`` tensors: from the index if there is one, else by header."""
    index = source / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        return sorted({source / file for name, file in weight_map.items() if name.startswith(PREFIX)})
    return [file for file, header in headers(source).items() if any(k.startswith(PREFIX) for k in header)]


def copy_tokenizer(source: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)


def split_source(source: Path, out: Path, *, force: bool, splittable: Collection[str]) -> dict[str, Any]:
    """The raw checkpoint *source*'s config, once every check before a split passes: a checkpoint of a
    ``model_type`` in *splittable*, and an *out* that is not the source and holds no other checkpoint (one
    split before only with *force*). Raises :class:`DrafterError` with one line for every way it fails."""
    config_path = source / "config.json"
    if not config_path.is_file():
        raise DrafterError(f"{source} has no config.json; expected a raw Hugging Face checkpoint")
    config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
    model_type = config.get("model_type")
    if model_type not in splittable:
        raise DrafterError(f"{source} is a {model_type!r} checkpoint; split-mtp extracts the MTP head of "
                           f"{', '.join(sorted(splittable))} checkpoints")
    if out.resolve() == source.resolve():
        raise DrafterError("the output directory is the source checkpoint")
    if (out / "config.json").exists() and not force:
        raise DrafterError(f"{out} already holds a checkpoint (it has a config.json); pass --force to replace it")
    others = sorted(f.name for f in out.glob("*.safetensors") if f.name != "model.safetensors") if out.is_dir() else []
    if others:  # --force replaces a drafter; it never deletes what looks like someone's weights
        raise DrafterError(f"{out} holds other weights ({', '.join(others[:3])}); choose an empty directory")
    return config
