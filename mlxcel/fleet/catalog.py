"""Which models a server may serve, by which names: ``--model``, ``--model-dir`` and ``--models FILE``.

Pure Python: it reads directory listings and a TOML file, never a tensor. A
directory counts as a checkpoint when it holds a ``config.json`` and safetensors
weights; whether it really loads is found when it is first asked for (a broken
one fails alone, and the others keep serving).

A request's ``model`` resolves by exact name first (every model's names, its
directory's name among them), then by shell-style pattern (``claude-haiku-*``)
in the order the models were declared; no ``model``, or ``default``, means the
first model declared.
"""

from __future__ import annotations

import contextlib
import fnmatch
import tomllib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class CatalogError(Exception):
    """The models the server was told to serve cannot be served as told (one line, for the start-up)."""


#: Per-model serving options a ``[[models]]`` table may set (the ``mlxcel serve`` flags of the same names, with
#: ``-`` as ``_``), and the type each takes.
MODEL_OPTIONS: dict[str, type] = {"draft_block_size": int, "kv_bits": int, "parallel": int, "prefill_step_size": int,
                                  "max_tokens": int}
_TABLE_KEYS = {"path", "names", "draft", "mtp", "pin", "idle_unload", *MODEL_OPTIONS}


@dataclass(frozen=True)
class ModelEntry:
    """One servable model: where it is, the names requests may give it, and how to serve it."""

    path: Path
    names: tuple[str, ...] = ()
    """Exact names and patterns, as declared (a discovered model: its one name)."""
    draft: Path | None = None
    """A standalone MTP drafter's directory."""
    mtp: bool = False
    """Draft with the checkpoint's own MTP head."""
    pin: bool = False
    """Never unloaded to make room, nor when idle."""
    idle_unload: float | None = None
    """Seconds without a request after which it is unloaded (None: the server's ``--idle-unload``)."""
    options: dict[str, int] = field(default_factory=dict)
    """Serving options of :data:`MODEL_OPTIONS` that this model sets apart from the server's flags."""

    @property
    def id(self) -> str:
        """The name ``/v1/models`` lists and answers name: its first exact name, else its directory's."""
        return next((n for n in self.names if not is_pattern(n)), self.path.name)

    @property
    def exact_names(self) -> tuple[str, ...]:
        """Every exact name, the id first, the directory's name last."""
        return tuple(dict.fromkeys([self.id, *(n for n in self.names if not is_pattern(n)), self.path.name]))

    @property
    def patterns(self) -> tuple[str, ...]:
        return tuple(n for n in self.names if is_pattern(n))


def is_pattern(name: str) -> bool:
    """Whether *name* is a shell-style pattern (``*``, ``?`` or ``[...]``), matched with :func:`fnmatch.fnmatchcase`."""
    return any(c in name for c in "*?[")


class Catalog:
    """The models declared, in order, and how a request's name picks one."""

    def __init__(self, entries: Sequence[ModelEntry]) -> None:
        if not entries:
            raise CatalogError("no model to serve: --model, --model-dir or --models found none")
        paths: set[Path] = set()
        for entry in entries:
            if entry.path.resolve() in paths:
                raise CatalogError(f"the model {entry.path} is declared twice")
            paths.add(entry.path.resolve())
        claimed: dict[str, ModelEntry] = {}
        for entry in entries:
            for name in (*entry.exact_names, *entry.patterns):
                other = claimed.get(name)
                if other is not None and other is not entry:
                    raise CatalogError(f"the name {name!r} is claimed by two models: {other.path} and {entry.path}")
                claimed[name] = entry
        self.entries = tuple(entries)
        self._exact = {name: entry for entry in entries for name in entry.exact_names}

    @property
    def default(self) -> ModelEntry:
        """The first model declared: what a request without a ``model`` (or with ``default``) gets."""
        return self.entries[0]

    def resolve(self, name: str | None) -> ModelEntry | None:
        """The model a request naming *name* means, or None when no model answers to it."""
        if name is None or name == "default":
            return self.default
        entry = self._exact.get(name)
        if entry is not None:
            return entry
        return next((e for e in self.entries if any(fnmatch.fnmatchcase(name, p) for p in e.patterns)), None)

    def ids(self) -> list[str]:
        return [entry.id for entry in self.entries]


def is_checkpoint(directory: Path) -> bool:
    """Whether *directory* looks servable: a ``config.json`` beside safetensors weights."""
    try:
        return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))
    except OSError:
        return False


def discover(root: Path) -> list[ModelEntry]:
    """The checkpoints under *root*, each named as its layout names it: a plain directory by its name,
    Hugging Face's hub cache (``models--ORG--NAME/snapshots/REV/``) as ``ORG/NAME``, LM Studio's
    ``ORG/NAME/`` as ``ORG/NAME``; *root* itself when it is one. Anything else is skipped."""
    if not root.is_dir():
        raise CatalogError(f"--model-dir {root}: not a directory")
    if is_checkpoint(root):
        return [ModelEntry(root, (root.name,))]
    found: list[ModelEntry] = []
    for child in _children(root):
        if child.name.startswith("models--"):
            snapshot = _hub_snapshot(child)
            if snapshot is not None:
                found.append(ModelEntry(snapshot, (child.name.removeprefix("models--").replace("--", "/", 1),)))
        elif is_checkpoint(child):
            found.append(ModelEntry(child, (child.name,)))
        else:
            found += [ModelEntry(inner, (f"{child.name}/{inner.name}",)) for inner in _children(child)
                      if is_checkpoint(inner)]
    return found


def _children(directory: Path) -> list[Path]:
    try:
        return sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))
    except OSError:
        return []


def _hub_snapshot(repo: Path) -> Path | None:
    """The snapshot a hub cache repo's ``refs/main`` names, else its newest servable one."""
    try:
        revision = (repo / "refs" / "main").read_text().strip()
    except OSError:
        revision = ""
    if revision and is_checkpoint(repo / "snapshots" / revision):
        return repo / "snapshots" / revision
    snapshots = [s for s in _children(repo / "snapshots") if is_checkpoint(s)]
    return max(snapshots, key=lambda s: s.stat().st_mtime, default=None)


def read_models_file(path: Path) -> list[ModelEntry]:
    """The ``[[models]]`` tables of a ``--models`` TOML file, each checked (:class:`CatalogError` names the
    table and the key at fault). Relative paths are the file's directory's."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CatalogError(f"--models {path}: cannot read it ({exc.strerror or exc})") from exc
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise CatalogError(f"--models {path}: not valid TOML ({exc})") from exc
    unknown = set(data) - {"models"}
    if unknown:
        raise CatalogError(f"--models {path}: unknown top-level key {sorted(unknown)[0]!r} (tables go in [[models]])")
    tables = data.get("models")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise CatalogError(f"--models {path}: no [[models]] table")
    return [_entry(path, i, table) for i, table in enumerate(tables, 1)]


def _entry(file: Path, index: int, table: dict[str, Any]) -> ModelEntry:
    where = f"--models {file}, model {index}"
    unknown = sorted(set(table) - _TABLE_KEYS)
    if unknown:
        raise CatalogError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(_TABLE_KEYS))})")
    if not isinstance(table.get("path"), str) or not table["path"]:
        raise CatalogError(f"{where}: 'path' (the model's directory) is required, as a string")
    model = _path(file, table["path"])
    names = table.get("names", [])
    if not isinstance(names, list) or not all(_valid_name(n) for n in names):
        raise CatalogError(f"{where}: 'names' must be a list of names (1 to 256 printable characters, no spaces)")
    draft = table.get("draft")
    if draft is not None and (not isinstance(draft, str) or not draft):
        raise CatalogError(f"{where}: 'draft' must be a drafter's directory, as a string")
    flags = {}
    for key in ("mtp", "pin"):
        if not isinstance(table.get(key, False), bool):
            raise CatalogError(f"{where}: {key!r} must be true or false")
        flags[key] = bool(table.get(key, False))
    if draft is not None and flags["mtp"]:
        raise CatalogError(f"{where}: 'draft' and 'mtp = true' are two drafters; name one")
    idle = table.get("idle_unload")
    options: dict[str, int] = {}
    for key in MODEL_OPTIONS:
        if key in table:
            value = table[key]
            if type(value) is not int or value < 1:
                raise CatalogError(f"{where}: {key!r} must be a positive integer")
            options[key] = value
    return ModelEntry(model, tuple(names), _path(file, draft) if draft is not None else None, flags["mtp"],
                      flags["pin"], None if idle is None else parse_duration(idle, f"{where}: 'idle_unload'"),
                      options)


def _path(file: Path, text: str) -> Path:
    path = Path(text).expanduser()
    return path if path.is_absolute() else file.parent / path


def _valid_name(name: object) -> bool:
    return (isinstance(name, str) and 0 < len(name) <= 256 and name.isprintable()
            and not any(c.isspace() for c in name))


_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: object, what: str = "a duration") -> float:
    """Seconds from ``90``, ``"90s"``, ``"10m"``, ``"1.5h"`` or ``"1d"`` (above 0, at most 30 days)."""
    seconds = float("nan")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip().lower()
        unit = next((u for u in ("ms", "s", "m", "h", "d") if text.endswith(u)), "")
        with contextlib.suppress(ValueError):
            seconds = float(text.removesuffix(unit)) * _DURATION_UNITS.get(unit, 1.0)
    if not 0 < seconds <= 30 * 86400:
        raise CatalogError(f"{what} must be a duration such as 90s, 10m or 2h, not {value!r}")
    return seconds


def catalog(model: Path | None, model_dirs: Iterable[Path], models_file: Path | None) -> Catalog:
    """The catalog the flags declare: ``--model`` first, then ``--models``' tables, then each ``--model-dir``'s
    finds (a model both declared and found is served once, as declared)."""
    entries: list[ModelEntry] = [ModelEntry(model)] if model is not None else []
    if models_file is not None:
        entries += read_models_file(models_file)
    declared = {entry.path.resolve() for entry in entries}
    for root in model_dirs:
        for entry in discover(root):
            if entry.path.resolve() not in declared:
                declared.add(entry.path.resolve())
                entries.append(entry)
    return Catalog(entries)
