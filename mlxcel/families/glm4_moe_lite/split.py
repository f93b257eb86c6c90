"""``mlxcel split-mtp`` for GLM-4.7-Flash: the raw next-token layer as a ``glm4_moe_lite_mtp`` directory.

Streams: the output's shapes are planned from the safetensors headers of the
shards that hold the layer (found through the index; the other shards are
never opened), the output header is written first, then each tensor is read,
transformed and written at its offset one at a time. Peak memory is one
source tensor (one expert's matrix, the embedding or the head), not the layer.

The transform gives the layout mlx-lm's ``glm4_moe_lite`` sanitize gives a
target layer, under the names of :class:`.glm4_moe_lite_mtp.Glm4MoeLiteMTP`:

- ``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj`` -> ``model.*``;
  ``shared_head.norm`` -> ``model.shared_head_norm``; ``shared_head.head`` ->
  ``lm_head``; the decoder block -> ``model.mtp_block.*``; ``rotary_emb`` buffers dropped;
- ``self_attn.kv_b_proj`` (heads x (nope + v), rank) -> ``embed_q`` (heads, rank,
  nope) and ``unembed_out`` (heads, v, rank);
- ``mlp.experts.{e}.{proj}`` -> ``mlp.switch_mlp.{proj}`` stacked (experts, out, in);
- dtypes kept (the raw checkpoint's bf16), the router's correction bias in float32;
- optionally affine-quantized (:func:`.glm4_moe_lite_mtp.quantizable`), the router gate left alone.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...models.drafters.loader import DrafterError
from . import mtp as glm

_DTYPES = {"F32": 4, "F16": 2, "BF16": 2, "U32": 4}  # bytes per element
_EXPERT = "mlp.experts."


@dataclass(slots=True)
class _Tensor:
    """A tensor of the output file."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count * _DTYPES[self.dtype]


@dataclass(slots=True)
class _Output:
    """One transformed source tensor, the pieces it is made of (one per expert when stacked), and the
    output tensors it is written as (its ``weight``, ``scales`` and ``biases`` when quantized)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    pieces: list[tuple[Path, str]] = field(default_factory=list)
    make: str = "copy"
    """How a piece is read: ``copy``, or ``embed_q`` / ``unembed_out`` (the halves of kv_b_proj)."""
    quantize: tuple[int, int] | None = None
    """(bits, group size) when quantized."""

    def tensors(self) -> dict[str, _Tensor]:
        if self.quantize is None:
            return {"weight": _Tensor(self.name, self.dtype, self.shape)}
        (bits, group), stem, rows, cols = self.quantize, self.name[:-len(".weight")], self.shape[:-1], self.shape[-1]
        return {"weight": _Tensor(self.name, "U32", (*rows, cols * bits // 32)),
                "scales": _Tensor(f"{stem}.scales", self.dtype, (*rows, cols // group)),
                "biases": _Tensor(f"{stem}.biases", self.dtype, (*rows, cols // group))}


def _rename(rest: str) -> str:
    if rest.startswith(("embed_tokens.", "enorm.", "hnorm.", "eh_proj.")):
        return f"model.{rest}"
    if rest.startswith("shared_head.norm."):
        return "model.shared_head_norm." + rest[len("shared_head.norm."):]
    if rest.startswith("shared_head.head."):
        return "lm_head." + rest[len("shared_head.head."):]
    return f"model.mtp_block.{rest}"


def _plan(files: dict[Path, dict[str, Any]], prefix: str, text: dict[str, Any]) -> list[_Output]:
    """The output tensors (unquantized) from the source headers of the next-token layer."""
    heads, nope, v = (int(text[k]) for k in ("num_attention_heads", "qk_nope_head_dim", "v_head_dim"))
    outputs: dict[str, _Output] = {}
    for file, header in files.items():
        for raw, info in sorted(header.items()):
            if not raw.startswith(prefix) or raw.endswith("rotary_emb.inv_freq"):
                continue
            rest, dtype, shape = raw[len(prefix):], info["dtype"], tuple(info["shape"])
            if rest.endswith((".scales", ".biases")) or dtype not in ("F32", "F16", "BF16"):
                raise DrafterError(f"{raw} in {file.name} is already quantized ({dtype}); split-mtp needs the raw "
                                   "zai-org checkpoint")
            if rest.endswith("e_score_correction_bias"):
                dtype = "F32"
            if rest.endswith("self_attn.kv_b_proj.weight"):
                base = _rename(rest)[:-len("kv_b_proj.weight")]
                rank = shape[-1]
                if shape[0] != heads * (nope + v):
                    raise DrafterError(f"{raw} has shape {list(shape)}; the config says {heads} heads x "
                                       f"({nope} + {v})")
                outputs[base + "embed_q.weight"] = _Output(base + "embed_q.weight", dtype, (heads, rank, nope),
                                                           [(file, raw)], "embed_q")
                outputs[base + "unembed_out.weight"] = _Output(base + "unembed_out.weight", dtype, (heads, v, rank),
                                                               [(file, raw)], "unembed_out")
            elif rest.startswith(_EXPERT):
                proj = rest[len(_EXPERT):].split(".", 1)[1]
                name = _rename(f"mlp.switch_mlp.{proj}")
                out = outputs.setdefault(name, _Output(name, dtype, shape))
                out.pieces.append((file, raw))
                out.pieces.sort(key=lambda piece: int(piece[1][len(prefix + _EXPERT):].split(".")[0]))
            else:
                outputs[_rename(rest)] = _Output(_rename(rest), dtype, shape, [(file, raw)])
    for out in outputs.values():
        if len(out.pieces) > 1:
            out.shape = (len(out.pieces), *out.shape)
    return sorted(outputs.values(), key=lambda o: o.name)


def _piece(out: _Output, file: Path, raw: str, text: dict[str, Any]) -> dict[str, Any]:
    """One piece of *out* read from *file* alone and transformed: its arrays by part (see :meth:`_Output.tensors`)."""
    import mlx.core as mx

    # mx.load is lazy: the other tensors of the file are never read (safetensors' own reader
    # goes through numpy, which has no bfloat16).
    tensors: dict[str, mx.array] = mx.load(str(file))  # type: ignore[assignment]
    value = tensors.pop(raw)
    del tensors
    if out.make != "copy":
        heads, nope = int(text["num_attention_heads"]), int(text["qk_nope_head_dim"])
        value = value.reshape(heads, -1, value.shape[-1])
        value = value[:, :nope, :].swapaxes(-1, -2) if out.make == "embed_q" else value[:, nope:, :]
    value = mx.contiguous(value.astype({"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}[out.dtype]))
    if out.quantize is None:
        return {"weight": value}
    bits, group = out.quantize
    weight, scales, biases = mx.quantize(value, group_size=group, bits=bits)
    return {"weight": weight, "scales": scales, "biases": biases}


def _array_bytes(value: Any) -> memoryview:
    """The array's bytes without a copy (MLX arrays export their buffer; as uint8 for bfloat16's sake)."""
    import mlx.core as mx

    data = mx.contiguous(value).view(mx.uint8)
    mx.eval(data)
    return memoryview(data).cast("B")  # type: ignore[arg-type]


def _write(path: Path, outputs: list[_Output], text: dict[str, Any], report: Callable[[str], None]) -> int:
    """A safetensors file written piece by piece at the offsets its header (written first) names.
    Returns the number of tensors written."""
    import mlx.core as mx

    tensors = sorted((t for o in outputs for t in o.tensors().values()), key=lambda t: t.name)
    header: dict[str, Any] = {"__metadata__": {"format": "mlx"}}
    offsets, end = {}, 0
    for tensor in tensors:
        header[tensor.name] = {"dtype": tensor.dtype, "shape": list(tensor.shape),
                               "data_offsets": [end, end + tensor.size]}
        offsets[tensor.name], end = end, end + tensor.size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    start = 8 + len(encoded)
    total, done = sum(len(o.pieces) for o in outputs), 0
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        f.truncate(start + end)
        for out in outputs:
            parts = out.tensors()
            for number, (file, raw) in enumerate(out.pieces):
                for part, value in _piece(out, file, raw, text).items():
                    data = _array_bytes(value)
                    tensor = parts[part]
                    if data.nbytes * len(out.pieces) != tensor.size:
                        raise DrafterError(f"{raw} in {file.name} does not have the shape its header says")
                    f.seek(start + offsets[tensor.name] + number * data.nbytes)
                    f.write(data)
                # MLX keeps freed buffers for reuse; tensors of many sizes would pile up to the layer's size.
                mx.clear_cache()
                done += 1
                if done == total or done % max(1, total // 10) == 0:
                    report(f"copied {done}/{total} source tensors ({out.name})")
    return len(tensors)


def _layer_files(source: Path, prefix: str) -> dict[Path, dict[str, Any]]:
    """The headers of the shards that hold *prefix* tensors (through the index; the others stay closed)."""
    index = source / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        names = sorted({file for name, file in weight_map.items() if name.startswith(prefix)})
        return {source / name: _header(source / name) for name in names}
    headers = {file: _header(file) for file in sorted(source.glob("*.safetensors"))}
    return {file: header for file, header in headers.items() if any(k.startswith(prefix) for k in header)}


def _header(file: Path) -> dict[str, Any]:
    """The raw header: each tensor's dtype, shape and byte offsets, which the streaming transform reads
    directly (``safetensors.safe_open`` gives no offsets)."""
    with file.open("rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header


def split_glm(source: Path, out: Path, config: dict[str, Any], *, block_size: int | None,
              quantize: tuple[int, int] | None, report: Callable[[str], None]) -> tuple[int, int]:
    """Write *source*'s next-token layer to ``out/model.safetensors`` and ``out/config.json``.

    *quantize*: (bits, group size). Returns (tensors written, the K the config names).
    """
    text = glm.text_config(config)
    prefix = f"model.layers.{int(text['num_hidden_layers'])}."
    files = _layer_files(source, prefix)
    if not files:
        raise DrafterError(f"{source} has no {prefix}* tensors: it was converted without its MTP layer; "
                           "use the raw zai-org checkpoint")
    report(f"reading the next-token layer from {len(files)} shard(s): {', '.join(f.name for f in files)}")
    outputs = _plan(files, prefix, text)
    if quantize is not None:
        for output in outputs:
            output.quantize = quantize if glm.quantizable(output.name, output.shape, quantize[1]) else None
    block = block_size if block_size is not None else glm.default_block_size(config)
    quantization = None if quantize is None else {"group_size": quantize[1], "bits": quantize[0]}
    split_config = glm.standalone_config(config, block, quantization)
    try:
        expected = glm.inventory(split_config)
    except (TypeError, ValueError, KeyError) as exc:
        raise DrafterError(f"{source / 'config.json'} is not a usable glm4_moe_lite config: {exc}") from exc
    found = {t.name: t.shape for o in outputs for t in o.tensors().values()}
    if found != expected:
        odd = sorted(set(found) ^ set(expected)) or sorted(n for n in found if found[n] != expected[n])
        raise DrafterError(f"the {prefix}* tensors of {source} do not form a glm4_moe_lite next-token layer for its "
                           f"config (first differences: {', '.join(odd[:4])})")
    out.mkdir(parents=True, exist_ok=True)
    written = _write(out / "model.safetensors", outputs, text, report)
    (out / "config.json").write_text(json.dumps(split_config, indent=2) + "\n", encoding="utf-8")
    return written, block
