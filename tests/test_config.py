"""Environment parsing: strict, with one clear line per malformed value."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import platformdirs
import pytest

from mlxcel.config import ConfigError, load_env


def test_defaults() -> None:
    env = load_env({})
    assert (env.policy.adaptive, env.policy.pin, env.policy.allow_inexact) == (True, None, False)
    assert env.policy.samples_required == 4 and env.draft_block_size is None
    assert env.cache_root == platformdirs.user_cache_path("mlxcel")


@pytest.mark.parametrize("value", ["0", "false", "No", "OFF", " off "])
def test_adaptive_off_values(value: str) -> None:
    assert load_env({"MLXCEL_MTP_ADAPTIVE": value}).policy.adaptive is False


@pytest.mark.parametrize(("value", "pin"), [
    ("0", False), ("false", False), ("No", False), ("off", False),
    ("1", True), ("on", True), ("yes", True), ("please", True), ("", None),
])
def test_pin_any_set_value_pins(value: str, pin: bool | None) -> None:
    assert load_env({"MLXCEL_ENABLE_MTP_B1": value}).policy.pin is pin


@pytest.mark.parametrize("value", ["1", "true", "YES", "on"])
def test_allow_inexact(value: str) -> None:
    assert load_env({"MLXCEL_MTP_ALLOW_INEXACT": value}).policy.allow_inexact is True


def test_block_size_and_cache(tmp_path: Path) -> None:
    env = load_env({"MLXCEL_DRAFT_BLOCK_SIZE": "3", "MLXCEL_CACHE_DIR": str(tmp_path),
                    "MLXCEL_MTP_PROFILE_SAMPLES": "2"})
    assert (env.draft_block_size, env.cache_root, env.policy.samples_required) == (3, tmp_path, 2)


@pytest.mark.parametrize(("variable", "value", "accepted"), [
    ("MLXCEL_DRAFT_BLOCK_SIZE", "abc", "an integer from 2 to 32"),
    ("MLXCEL_DRAFT_BLOCK_SIZE", "0", "an integer from 2 to 32"),
    ("MLXCEL_DRAFT_BLOCK_SIZE", "1", "an integer from 2 to 32"),
    ("MLXCEL_DRAFT_BLOCK_SIZE", "4.5", "an integer from 2 to 32"),
    ("MLXCEL_DRAFT_BLOCK_SIZE", "33", "an integer from 2 to 32"),
    ("MLXCEL_MTP_PROFILE_SAMPLES", "0", "an integer from 1 to 1000"),
    ("MLXCEL_MTP_ADAPTIVE", "maybe", "one of 1/true/yes/on or 0/false/no/off"),
    ("MLXCEL_MTP_ALLOW_INEXACT", "2", "one of 1/true/yes/on or 0/false/no/off"),
])
def test_malformed_values_name_the_variable_and_the_accepted_values(variable: str, value: str,
                                                                      accepted: str) -> None:
    with pytest.raises(ConfigError) as error:
        load_env({variable: value})
    message = str(error.value)
    assert message.startswith(f"{variable}={value!r} is not valid: expected {accepted}")
    assert "\n" not in message


def test_cli_exits_2_with_one_line() -> None:
    env = {**os.environ, "MLXCEL_DRAFT_BLOCK_SIZE": "abc"}
    result = subprocess.run([sys.executable, "-m", "mlxcel", "config"], env=env, capture_output=True,
                            text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        "mlxcel: MLXCEL_DRAFT_BLOCK_SIZE='abc' is not valid: expected an integer from 2 to 32 "
        "(the verify width K: K-1 drafts per round)"]
