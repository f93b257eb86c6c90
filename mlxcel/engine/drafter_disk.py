"""An MTP drafter's state beside a prompt cache on disk, so that a prompt resumed after a restart drafts at once.

A drafter's ``snapshot()`` is its own shape (a head's KV caches and the last hidden state it read; Gemma 4's
assistant's hidden state and token): a tree of MLX arrays, numbers, ``None``, lists and tuples, and caches that
rebuild themselves with ``from_state`` (mlx-lm's, or a family's). It is written as one safetensors file,
the tree's shape in its metadata, next to the entry's file (``<sha256 of the tokens>.drafter.safetensors``),
with the drafter's identity (its name and quantization) and the token after the entry's tokens that it
has read, by the disk tier's writer thread after the entry's file (:mod:`.disk_writes`). It is optional: a
file missing, damaged, or of another drafter means the prompt resumes with a fresh drafter, as it would
without it. Worker thread only (what it hands the writer calls no MLX).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .disk_files import checksum, is_regular
from .disk_writes import Tensors, ready

FORMAT = "2"
"""2: the arrays' checksum in the metadata, checked on read."""
SUFFIX = ".drafter.safetensors"
CHECKSUM_KEY = "mlxcel_checksum"
"""Where a drafter file's metadata keeps its arrays' checksum."""


def _encode(node: Any, arrays: dict[str, Any]) -> Any:
    """*node* as JSON, its arrays moved into *arrays* under the names the JSON gives."""
    import mlx.core as mx

    if node is None:
        return None
    if isinstance(node, bool | int | float | str):
        return {"value": node}
    if isinstance(node, mx.array):
        name = f"a{len(arrays)}"
        arrays[name] = node
        return {"array": name}
    if isinstance(node, list | tuple):
        return {type(node).__name__: [_encode(item, arrays) for item in node]}
    if hasattr(node, "state") and hasattr(type(node), "from_state"):
        return {"cache": type(node).__name__, "state": _encode(list(node.state), arrays)}
    raise TypeError(f"a drafter's state holds a {type(node).__name__}, which is not kept on disk")


def _decode(node: Any, arrays: dict[str, Any], classes: dict[str, Any]) -> Any:
    if node is None:
        return None
    if "value" in node:
        return node["value"]
    if "array" in node:
        return arrays[node["array"]]
    if "list" in node:
        return [_decode(item, arrays, classes) for item in node["list"]]
    if "tuple" in node:
        return tuple(_decode(item, arrays, classes) for item in node["tuple"])
    return classes[node["cache"]].from_state(_decode(node["state"], arrays, classes))


def prepare(drafter: str, token: int, state: Any) -> Tensors:
    """*state* (a drafter's ``snapshot()``, which has read *token* after the entry's tokens) made ready to be
    written by the disk tier's writer (:func:`.disk_writes.write`); raises what the encoding raises."""
    arrays: dict[str, Any] = {}
    shape = _encode(state, arrays)
    return ready(arrays, {"mlxcel_drafter_format": FORMAT, "mlxcel_drafter": drafter, "mlxcel_token": str(token),
                          "mlxcel_shape": json.dumps(shape)}, checksum_key=CHECKSUM_KEY)


def decode(tensors: Tensors, classes: dict[str, Any]) -> tuple[int, Any]:
    """The (token, state) that :func:`prepare` made *tensors* from, over the same arrays."""
    return int(tensors.metadata["mlxcel_token"]), _decode(json.loads(tensors.metadata["mlxcel_shape"]),
                                                          tensors.arrays, classes)


def load(path: Path, drafter: str, classes: dict[str, Any], verified: bool = False) -> tuple[int, Any] | None:
    """(the token it has read, the state) in *path*, or None when there is no file or it is *drafter*'s
    no longer; raises when the file is damaged (its checksum is not checked again when *verified*)."""
    import mlx.core as mx

    if not is_regular(path):
        return None
    loaded: Any = mx.load(str(path), return_metadata=True)
    arrays, metadata = loaded
    if metadata.get("mlxcel_drafter_format") != FORMAT or metadata.get("mlxcel_drafter") != drafter:
        return None
    if not verified and checksum(arrays) != metadata.get(CHECKSUM_KEY):
        raise ValueError("its arrays do not match their checksum")
    state = _decode(json.loads(metadata["mlxcel_shape"]), arrays, classes)
    mx.eval([a for a in arrays.values()])
    return int(metadata["mlxcel_token"]), state
