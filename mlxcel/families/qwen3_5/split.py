"""``mlxcel split-mtp`` for Qwen 3.5 / 3.6 / 3.8: the raw checkpoint's ``mtp.*`` tensors as a standalone head."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...models.drafters.loader import PREFIX, DrafterError, raw_layout
from ...models.drafters.split import copy_tokenizer, head_files


def split_qwen(source: Path, out: Path, config: dict[str, Any], *, block_size: int | None,
               quantize: tuple[int, int] | None, report: Callable[[str], None]) -> Path:
    import mlx.core as mx

    from . import mtp

    if quantize is not None:
        raise DrafterError("--q-bits quantizes GLM-4.7-Flash's next-token layer; a Qwen head is written as it is "
                           "(quantize it at load with --draft-quantize)")
    block_size = 3 if block_size is None else block_size
    files = head_files(source)
    if not files:
        raise DrafterError(f"{source} has no {PREFIX}* tensors: it was converted without its MTP layer; "
                           "use the raw checkpoint")
    weights: dict[str, Any] = {}
    for number, file in enumerate(files, 1):
        tensors: dict[str, Any] = mx.load(str(file))  # type: ignore[assignment]
        head = {name[len(PREFIX):]: value for name, value in tensors.items() if name.startswith(PREFIX)}
        weights.update(head)
        report(f"read {len(head)} head tensors from {file.name} ({number}/{len(files)} shards)")
    weights = mtp.stack_experts(weights)  # a Qwen 3.6 MoE head's experts as mlx-lm holds them
    if raw_layout(source):  # the standalone layout is the model's own: norms already shifted
        weights = mtp.shift_norms(weights)
    split_config = mtp.standalone_config(config, block_size)
    expected = mtp.inventory(split_config)
    found = {name: tuple(value.shape) for name, value in weights.items()}
    if found != expected:
        odd = sorted(set(found) ^ set(expected)) or sorted(n for n in found if found[n] != expected[n])
        raise DrafterError(f"the {PREFIX}* tensors of {source} do not form a {mtp.STANDALONE_TYPE} head for its "
                           f"config (first differences: {', '.join(odd[:4])})")
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(split_config, indent=2) + "\n", encoding="utf-8")
    copy_tokenizer(source, out)
    report(f"wrote {len(weights)} tensors to {out} (model_type {mtp.STANDALONE_TYPE}, block_size {block_size})")
    return out
