"""Hugging Face-layout checkpoints: check one cheaply up front, load it on the worker.

:func:`inspect_checkpoint` runs before the HTTP port is bound, so that a
directory that is missing, has no ``config.json``, names an unsupported
``model_type`` or holds broken weights stops startup with one clear line. It
reads only JSON and safetensors headers. :func:`load_checkpoint` does the real
load through mlx-lm, on the engine's worker thread, with progress logged.

Neither knows any family: what a family changes is handed in (*own_models*, a
:class:`ModelHooks`); :mod:`mlxcel.checkpoints` hands in the checkpoint's own.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import resource
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """The checkpoint cannot be served; ``str()`` is one line saying why."""


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    path: Path
    name: str
    """Directory basename: the model id and the policy's ``target``."""
    model_type: str
    context_length: int
    weight_files: tuple[Path, ...]
    weight_bytes: int
    config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """Its ``config.json``, read once here: whatever needs the target's config reads it from this."""


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json")


def _mlx_lm_utils() -> Any:
    """``mlx_lm.utils``, imported without its side effect on the open-file limit.

    Importing it sets RLIMIT_NOFILE to (2048, 4096) whatever the limit was: a
    higher hard limit is lowered for good (the server then has 2048
    descriptors, one per connection), and where the hard limit is below 4096
    the import raises ValueError and startup fails. The server sets the limit
    itself (``serve.raise_open_file_limit``). ``mlxcel serve`` makes this the
    first import of mlx-lm, before any thread starts (:func:`import_mlx_lm`).
    """
    if "mlx_lm.utils" not in sys.modules:
        real_setrlimit = resource.setrlimit

        def setrlimit(which: int, limits: tuple[int, int]) -> None:
            if which != resource.RLIMIT_NOFILE:
                real_setrlimit(which, limits)

        resource.setrlimit = setrlimit
        try:
            importlib.import_module("mlx_lm.utils")
        finally:
            resource.setrlimit = real_setrlimit
    return sys.modules["mlx_lm.utils"]


def import_mlx_lm() -> None:
    """Import mlx-lm now, on this thread, without its side effect on the open-file limit (see
    :func:`_mlx_lm_utils`): ``mlxcel serve`` calls it once the checks before binding have passed, so
    that a refused start never waits for mlx-lm's imports (transformers among them)."""
    _mlx_lm_utils()


def mlx_lm_module(model_type: str) -> Any:
    """mlx-lm's module for *model_type* (after its remapping), or None when mlx-lm has none."""
    name = _mlx_lm_utils().MODEL_REMAPPING.get(model_type, model_type)
    if importlib.util.find_spec(f"mlx_lm.models.{name}") is None:
        return None
    return importlib.import_module(f"mlx_lm.models.{name}")


class ModelHooks(Protocol):
    """What loading a checkpoint needs of its family (a :class:`mlxcel.families.Family`)."""

    own_model: bool
    """mlxcel carries the model file: :meth:`model_classes` builds it."""

    def config_overrides(self, config: dict[str, Any]) -> dict[str, Any]:
        """Config values mlx-lm must be given on top of the checkpoint's ``config.json``."""
        ...

    def model_classes(self, config: dict[str, Any]) -> tuple[Any, Any]:
        """(Model, ModelArgs) of an own model file."""
        ...

    def prepare(self, model: Any) -> None:
        """Change the loaded model in place before anything runs on it."""
        ...


def _supported(model_type: str, own_models: Collection[str]) -> bool:
    if model_type in own_models or _has_model_file(model_type):
        return True
    module = _mlx_lm_utils().MODEL_REMAPPING.get(model_type, model_type)
    return importlib.util.find_spec(f"mlx_lm.models.{module}") is not None


def _has_model_file(model_type: str) -> bool:
    """Whether mlx-lm has a model file of exactly this name, found without importing mlx-lm.

    Importing any of mlx-lm runs its package, which imports transformers (and torch, where installed):
    seconds that a start refused before binding (a bad key file, unreadable weights) should not wait
    for. A remapped name (mlx-lm's ``MODEL_REMAPPING``) still needs the import.
    """
    spec = importlib.util.find_spec("mlx_lm")  # a top-level name: located, not run
    locations = spec.submodule_search_locations if spec is not None else None
    return any((Path(location) / "models" / f"{model_type}.py").is_file() for location in locations or ())


def context_length(config: dict[str, Any]) -> int:
    """A config.json's context window (its own keys, or its text_config's), 4,096 where it names none."""
    for source in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_ctx"):
            value = source.get(key)
            if isinstance(value, int) and value > 0:
                return value
    return 4096


def _unreadable(path: Path, exc: OSError) -> CheckpointError:
    return CheckpointError(f"cannot read {path}: {exc.strerror or exc}")


def check_safetensors(path: Path) -> None:
    """A regular file whose header parses and whose data it describes fits the file exactly."""
    try:
        _read_safetensors_header(path)
    except OSError as exc:  # a dangling link, a directory of that name, no permission
        raise _unreadable(path, exc) from exc


def _read_safetensors_header(path: Path) -> None:
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        raise CheckpointError(f"{path} is not a regular file"
                              + (" (a dangling symbolic link)" if path.is_symlink() and not path.exists() else ""))
    try:  # safetensors checks the header parses and the data it describes covers the file exactly
        with safe_open(str(path), framework="numpy"):
            pass
    except SafetensorError as exc:
        raise CheckpointError(f"{path} is truncated or corrupt ({exc})") from exc


#: Activations mlx-lm's Qwen 3.5 computes for its gates; Qwen 3.8 names its own (``output_gate_type``).
_GATE_ACTIVATIONS = {"silu", "swish"}


def _check_config_keys(config: dict[str, Any], config_path: Path) -> None:
    """Config keys a newer release of a family added, which mlx-lm reads past: refuse the values it
    would silently compute wrongly. (Qwen 3.8's interleaved mrope and ``language_model_only`` change
    nothing for text: every mrope section sees the same text position.)"""
    nested = config.get("text_config")
    text: dict[str, Any] = nested if isinstance(nested, dict) else config
    gate = text.get("output_gate_type", config.get("output_gate_type"))
    if gate is not None and str(gate).lower() not in _GATE_ACTIVATIONS:
        raise CheckpointError(f"output_gate_type {gate!r} in {config_path} is not supported "
                              f"(mlx-lm computes {' / '.join(sorted(_GATE_ACTIVATIONS))})")


def inspect_checkpoint(path: str | Path, *, own_models: Collection[str]) -> CheckpointInfo:
    """Check *path* is a servable checkpoint without loading it; *own_models*: the ``model_type`` values
    mlxcel carries a model file for (mlx-lm serves the rest)."""
    directory = Path(path).expanduser()
    if not directory.is_dir():
        if directory.exists():
            raise CheckpointError(f"--model {directory} is not a directory; expected a Hugging Face-layout "
                                  "checkpoint directory")
        raise CheckpointError(f"model directory {directory} does not exist")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{directory} has no config.json; expected a Hugging Face-layout checkpoint")
    try:
        text = config_path.read_text(encoding="utf-8")
    except OSError as exc:
        raise _unreadable(config_path, exc) from exc
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{config_path} is not UTF-8 text: {exc}") from exc
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise CheckpointError(f"{config_path} is not valid JSON: {exc}") from exc
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if not isinstance(model_type, str) or not model_type:
        raise CheckpointError(f"{config_path} names no model_type")
    if not _supported(model_type, own_models):
        raise CheckpointError(f"model_type {model_type!r} in {config_path} is not supported")
    _check_config_keys(config, config_path)
    weights = tuple(sorted(directory.glob("model*.safetensors")))
    if not weights and (directory / "mtp.safetensors").is_file():
        raise CheckpointError(f"{directory} holds only an MTP drafter (mtp.safetensors), no target weights: "
                              "pass it as --draft-model, with the target checkpoint as --model")
    if not weights:
        raise CheckpointError(f"{directory} has no model*.safetensors weights")
    for file in weights:
        check_safetensors(file)
    tokenizers = [directory / name for name in _TOKENIZER_FILES if (directory / name).is_file()]
    if not tokenizers:
        raise CheckpointError(f"{directory} has no tokenizer (tokenizer.json or tokenizer.model)")
    for file in tokenizers:
        try:
            with file.open("rb") as f:
                f.read(1)
        except OSError as exc:
            raise _unreadable(file, exc) from exc
    return CheckpointInfo(path=directory, name=directory.resolve().name, model_type=model_type,
                          context_length=context_length(config), weight_files=weights,
                          weight_bytes=sum(f.stat().st_size for f in weights), config=config)


def load_checkpoint(info: CheckpointInfo, served: ModelHooks,
                    check: Callable[[], None] | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) through mlx-lm (or *served*'s own model file), materialising weights with progress
    logs; *served*: what the checkpoint's family changes.

    Must run on the thread that will use the model (MLX streams are thread-bound).
    *check* runs between the twenty slices the weights are read in: it raises
    to abandon the load (a server stopped while loading).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    load = _mlx_lm_utils().load  # `mlxcel serve` imported it before binding; a caller that did not, here
    started = time.perf_counter()
    logger.info("loading %s (%s, %.1f MB of weights)", info.name, info.model_type, info.weight_bytes / 1e6)
    try:
        config = info.config
        if served.own_model:  # mlxcel's own model file, through mlx-lm's loader
            from mlx_lm.utils import load_model, load_tokenizer

            model, _ = load_model(info.path, lazy=True, get_model_classes=served.model_classes)
            text = config.get("text_config") or {}
            tokenizer = load_tokenizer(info.path, eos_token_ids=config.get("eos_token_id", text.get("eos_token_id")))
        else:
            loaded: Any = load(str(info.path), lazy=True, model_config=served.config_overrides(config))
            model, tokenizer = loaded
        served.prepare(model)
    except Exception as exc:  # mlx-lm raises ValueError, KeyError, ... for broken checkpoints
        raise CheckpointError(f"cannot load {info.path}: {exc}") from exc
    tokenizer = declared_tokenizer(info.path, tokenizer)
    flat: Any = tree_flatten(model.parameters())
    parameters = [array for _, array in flat]
    step = max(1, len(parameters) // 20)
    last_report = time.perf_counter()
    for start in range(0, len(parameters), step):
        if check is not None:
            check()
        mx.eval(parameters[start:start + step])
        # Report at most once a second: silent for small models, steady for large ones.
        if time.perf_counter() - last_report >= 1.0:
            last_report = time.perf_counter()
            done = min(len(parameters), start + step)
            logger.info("loading %s: %d%% of tensors", info.name, round(100 * done / len(parameters)))
    model.eval()
    logger.info("loaded %s in %.1fs", info.name, time.perf_counter() - started)
    return model, tokenizer


def declared_tokenizer(directory: Path, wrapper: Any) -> Any:
    """*wrapper* (mlx-lm's ``TokenizerWrapper``) around the tokenizer the checkpoint's files declare.

    transformers 5 chooses the tokenizer class from ``config.json``'s
    ``model_type`` for many families (qwen2, qwen3_5, phi3, ...: its
    ``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS``), and a class with its own
    ``__init__`` rebuilds the tokenizer from ``tokenizer.json``'s vocabulary and
    merges with the class's own pre-tokenizer. A checkpoint whose
    ``tokenizer.json`` splits text differently (the bundled model splits digits
    the GPT-2 way) is then served with a tokenizer it was not trained on.
    ``tokenizer.json`` is the whole tokenizer, so when there is one (and no
    remote code is declared) transformers' generic ``TokenizersBackend`` loads
    it as it is, with ``tokenizer_config.json``'s special tokens and chat
    template. What mlx-lm derived besides (eos ids, chat template type, tool
    parser) is kept.
    """
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, NaiveStreamingDetokenizer
    from transformers import TokenizersBackend

    loaded = wrapper._tokenizer
    rebuilt = isinstance(loaded, TokenizersBackend) and "__init__" in type(loaded).__dict__
    if rebuilt and (directory / "tokenizer.json").is_file() and not _declares_remote_code(directory):
        try:
            declared = TokenizersBackend.from_pretrained(str(directory))
        except Exception as exc:  # a tokenizer.json the tokenizers library cannot read
            raise CheckpointError(f"cannot load {directory / 'tokenizer.json'}: {exc}") from exc
        logger.info("serving %s with its tokenizer.json, not transformers' %s", directory.name,
                    type(loaded).__name__)
        wrapper._tokenizer = declared
        if isinstance(wrapper._detokenizer, NaiveStreamingDetokenizer):
            # It decodes through the tokenizer; the BPE and SentencePiece ones hold only
            # the id -> token map, which is the same file's.
            wrapper._detokenizer = NaiveStreamingDetokenizer(declared)
    if type(wrapper._detokenizer) is BPEStreamingDetokenizer:
        from mlx_lm.tokenizer_utils import _byte_decoder


        class ByteLevelDetokenizer(BPEStreamingDetokenizer):  # type: ignore[misc]
            # mlx-lm drops the first token's leading space, as a SentencePiece decoder's
            # `Strip` does. A byte-level decoder strips nothing, and the space of a
            # completion's first token is text the model generated (`def f(x):` ->
            # ` return`): without the trim the streamed text is tokenizers' decode.
            def _maybe_trim_space(self, current_text: str) -> str:
                return current_text

            # mlx-lm tests the decoded byte for truth, so the token of byte 0 ("Ā") came out as
            # the character itself; every byte, 0 included, is decoded here.
            def _decode_bytes(self, seq: str) -> str:
                decoder = _byte_decoder()
                return b"".join(bytes([decoder[c]]) if c in decoder else c.encode() for c in seq).decode(
                    "utf-8", "replace")

        wrapper._detokenizer = ByteLevelDetokenizer(wrapper._tokenizer)
    return wrapper


def _declares_remote_code(directory: Path) -> bool:
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "auto_map" in config
