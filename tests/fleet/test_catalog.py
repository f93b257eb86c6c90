"""Which models a server serves and by which names: model-free (directories with a config.json and an empty
safetensors file stand for checkpoints; nothing is loaded)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mlxcel.fleet import Catalog, CatalogError, ModelEntry, catalog, discover, parse_duration, read_models_file


def _checkpoint(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(b"")
    return directory


def test_a_model_dir_names_plain_hub_and_lm_studio_layouts_and_skips_the_rest(tmp_path: Path) -> None:
    plain = _checkpoint(tmp_path / "Qwen3.5-0.8B")
    hub = tmp_path / "models--Qwen--Qwen3.5-9B"
    old, new = _checkpoint(hub / "snapshots" / "aaa"), _checkpoint(hub / "snapshots" / "bbb")
    (hub / "refs").mkdir()
    (hub / "refs" / "main").write_text("aaa\n")  # refs/main wins over the newer snapshot
    os.utime(new, (2e9, 2e9))
    studio = _checkpoint(tmp_path / "mlx-community" / "gemma-4-E2B-it-4bit")
    (tmp_path / "notes").mkdir()  # no config.json: skipped
    (tmp_path / "notes" / "config.json").write_text("{}")
    _checkpoint(tmp_path / "datasets--x")  # not a hub model repo's name: a plain checkpoint
    (tmp_path / ".cache").mkdir()
    found = {e.id: e.path for e in discover(tmp_path)}
    assert found == {"Qwen3.5-0.8B": plain, "Qwen/Qwen3.5-9B": old, "mlx-community/gemma-4-E2B-it-4bit": studio,
                     "datasets--x": tmp_path / "datasets--x"}


def test_a_hub_repo_without_refs_serves_its_newest_snapshot(tmp_path: Path) -> None:
    hub = tmp_path / "models--org--name"
    _checkpoint(hub / "snapshots" / "one")
    newest = _checkpoint(hub / "snapshots" / "two")
    os.utime(newest, (2e9, 2e9))
    assert [(e.id, e.path) for e in discover(tmp_path)] == [("org/name", newest)]


def test_names_resolve_exact_first_then_patterns_in_file_order(tmp_path: Path) -> None:
    big, small = _checkpoint(tmp_path / "big"), _checkpoint(tmp_path / "small")
    file = tmp_path / "models.toml"
    file.write_text(f'''
[[models]]
path = "{big}"
names = ["qwen", "claude-*"]
mtp = true
pin = true
parallel = 8

[[models]]
path = "small"
names = ["claude-haiku-*"]
idle_unload = "10m"
''')
    models = Catalog(read_models_file(file))
    assert [e.id for e in models.entries] == ["qwen", "small"]
    assert models.entries[1].path == small  # relative to the file
    assert models.resolve("claude-haiku-4-5") is models.resolve("claude-sonnet-4") is models.entries[0]  # file order
    assert models.resolve("small") is models.entries[1]  # an exact name before any pattern
    assert models.resolve(None) is models.resolve("default") is models.resolve("big") is models.entries[0]
    assert models.resolve("gpt-4o") is None
    first, second = models.entries
    assert (first.mtp, first.pin, first.options, second.idle_unload) == (True, True, {"parallel": 8}, 600.0)


def test_a_name_two_models_claim_is_an_error_naming_both(tmp_path: Path) -> None:
    one, two = _checkpoint(tmp_path / "one"), _checkpoint(tmp_path / "two")
    with pytest.raises(CatalogError, match=f"'coder' is claimed by two models: {one} and {two}"):
        Catalog([ModelEntry(one, ("coder",)), ModelEntry(two, ("coder",))])
    with pytest.raises(CatalogError, match="declared twice"):
        Catalog([ModelEntry(one, ("a",)), ModelEntry(one, ("b",))])


@pytest.mark.parametrize(("text", "problem"), [
    ("models = 3", "no \\[\\[models\\]\\] table"),
    ("[[models]]\nnames = ['x']", "'path'"),
    ("[[models]]\npath = 'x'\nbatch = 4", "unknown key 'batch'"),
    ("[[models]]\npath = 'x'\nnames = ['two words']", "'names' must be a list"),
    ("[[models]]\npath = 'x'\nparallel = 0", "'parallel' must be a positive integer"),
    ("[[models]]\npath = 'x'\nparallel = true", "'parallel' must be a positive integer"),
    ("[[models]]\npath = 'x'\npin = 'yes'", "'pin' must be true or false"),
    ("[[models]]\npath = 'x'\nidle_unload = 'soon'", "must be a duration"),
    ("[[models]]\npath = 'x'\nmtp = true\ndraft = 'd'", "two drafters"),
    ("[[models]\npath = 'x'", "not valid TOML"),
    ("[server]\nport = 1", "unknown top-level key 'server'"),
])
def test_a_bad_models_file_is_one_line_naming_the_table_and_key(tmp_path: Path, text: str, problem: str) -> None:
    file = tmp_path / "models.toml"
    file.write_text(text)
    with pytest.raises(CatalogError, match=problem):
        read_models_file(file)


def test_the_flags_together_declare_model_then_file_then_directories_once_each(tmp_path: Path) -> None:
    first = _checkpoint(tmp_path / "dir" / "first")
    second = _checkpoint(tmp_path / "dir" / "second")
    file = tmp_path / "models.toml"
    file.write_text(f'[[models]]\npath = "{second}"\nnames = ["two"]\n')
    models = catalog(first, [tmp_path / "dir"], file)
    assert [e.id for e in models.entries] == ["first", "two"]  # the directory's copies are not served twice
    with pytest.raises(CatalogError, match="not a directory"):
        catalog(None, [tmp_path / "missing"], None)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CatalogError, match="no model to serve"):
        catalog(None, [tmp_path / "empty"], None)


@pytest.mark.parametrize(("value", "seconds"), [("90", 90.0), (90, 90.0), ("90s", 90.0), ("10m", 600.0),
                                                ("1.5h", 5400.0), ("1d", 86400.0), ("250ms", 0.25)])
def test_durations(value: object, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["0", "-5m", "soon", "", True, "31d", "nan"])
def test_bad_durations(value: object) -> None:
    with pytest.raises(CatalogError):
        parse_duration(value)
