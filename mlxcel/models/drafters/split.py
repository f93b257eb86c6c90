"""``mlxcel split-mtp``: a raw checkpoint's MTP head, written out as a standalone drafter directory.

Quantized and community conversions of a target drop its MTP tensors (mlx-lm's
loader does not keep them), so the head has to come from the raw checkpoint,
once, into a directory that ``--draft-model`` serves beside any conversion of
the same target. Reads only the shards that hold the head (through the
checkpoint's ``model.safetensors.index.json`` when it has one).

Qwen 3.5 / 3.6 / 3.8 (``qwen3_5_mtp``), and GLM-4.7-Flash (``glm4_moe_lite_mtp``, its transform
in :mod:`.glm4_moe_lite_split`); other families add a branch here.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .loader import MTP_FAMILIES, PREFIX, DrafterError, _headers, _raw_layout

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "chat_template.jinja", "generation_config.json")


def _head_files(source: Path) -> list[Path]:
    """The safetensors files that hold ``mtp.*`` tensors: from the index if there is one, else by header."""
    index = source / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        return sorted({source / file for name, file in weight_map.items() if name.startswith(PREFIX)})
    return [file for file, header in _headers(source).items() if any(k.startswith(PREFIX) for k in header)]


def split_mtp(source: Path, out: Path, *, block_size: int | None = None, force: bool = False,
              quantize: tuple[int, int] | None = None, report: Callable[[str], None] = print) -> Path:
    """Write *source*'s MTP head to *out* (``config.json``, ``model.safetensors``, the tokenizer files).

    *block_size*: the K the config names (default: the family's). *quantize*: (bits, group size) of an
    affine quantization (GLM only). Raises :class:`DrafterError` with one line for every way this cannot be done.
    """
    import mlx.core as mx

    from . import qwen3_5_mtp

    config_path = source / "config.json"
    if not config_path.is_file():
        raise DrafterError(f"{source} has no config.json; expected a raw Hugging Face checkpoint")
    config: dict[str, Any] = json.loads(config_path.read_text(encoding="utf-8"))
    model_type = config.get("model_type")
    if model_type not in MTP_FAMILIES:
        raise DrafterError(f"{source} is a {model_type!r} checkpoint; split-mtp extracts the MTP head of "
                           f"{', '.join(sorted(MTP_FAMILIES))} checkpoints")
    if out.resolve() == source.resolve():
        raise DrafterError("the output directory is the source checkpoint")
    if (out / "config.json").exists() and not force:
        raise DrafterError(f"{out} already holds a checkpoint (it has a config.json); pass --force to replace it")
    others = sorted(f.name for f in out.glob("*.safetensors") if f.name != "model.safetensors") if out.is_dir() else []
    if others:  # --force replaces a drafter; it never deletes what looks like someone's weights
        raise DrafterError(f"{out} holds other weights ({', '.join(others[:3])}); choose an empty directory")
    if model_type == "glm4_moe_lite":
        return _split_glm(source, out, config, block_size, quantize, report)
    if quantize is not None:
        raise DrafterError("--q-bits quantizes GLM-4.7-Flash's next-token layer; a Qwen head is written as it is "
                           "(quantize it at load with --draft-quantize)")
    block_size = 3 if block_size is None else block_size
    files = _head_files(source)
    if not files:
        raise DrafterError(f"{source} has no {PREFIX}* tensors: it was converted without its MTP layer; "
                           "use the raw checkpoint")
    weights: dict[str, Any] = {}
    for number, file in enumerate(files, 1):
        tensors: dict[str, Any] = mx.load(str(file))  # type: ignore[assignment]
        head = {name[len(PREFIX):]: value for name, value in tensors.items() if name.startswith(PREFIX)}
        weights.update(head)
        report(f"read {len(head)} head tensors from {file.name} ({number}/{len(files)} shards)")
    weights = qwen3_5_mtp.stack_experts(weights)  # a Qwen 3.6 MoE head's experts as mlx-lm holds them
    if _raw_layout(source):  # the standalone layout is the model's own: norms already shifted
        weights = qwen3_5_mtp.shift_norms(weights)
    split_config = qwen3_5_mtp.standalone_config(config, block_size)
    expected = qwen3_5_mtp.inventory(split_config)
    found = {name: tuple(value.shape) for name, value in weights.items()}
    if found != expected:
        odd = sorted(set(found) ^ set(expected)) or sorted(n for n in found if found[n] != expected[n])
        raise DrafterError(f"the {PREFIX}* tensors of {source} do not form a qwen3_5_mtp head for its config "
                           f"(first differences: {', '.join(odd[:4])})")
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(split_config, indent=2) + "\n", encoding="utf-8")
    _copy_tokenizer(source, out)
    report(f"wrote {len(weights)} tensors to {out} (model_type {qwen3_5_mtp.STANDALONE_TYPE}, block_size {block_size})")
    return out


def _copy_tokenizer(source: Path, out: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, out / name)


def _split_glm(source: Path, out: Path, config: dict[str, Any], block_size: int | None,
               quantize: tuple[int, int] | None, report: Callable[[str], None]) -> Path:
    from .glm4_moe_lite_split import split_glm

    (out / "model.safetensors.index.json").unlink(missing_ok=True)  # a stale index would name other shards
    written, block = split_glm(source, out, config, block_size=block_size, quantize=quantize, report=report)
    _copy_tokenizer(source, out)
    if not (out / "tokenizer.json").is_file() and not (out / "tokenizer.model").is_file():
        report(f"warning: {source} has no tokenizer file; {out} has none either")
    bits = "" if quantize is None else f", {quantize[0]}-bit group {quantize[1]}"
    report(f"wrote {written} tensors to {out} (model_type glm4_moe_lite_mtp, block_size {block}{bits})")
    return out
