"""Environment variables, parsed strictly: a malformed value is an error, never a guess."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from .policy import DEFAULT_SAMPLES_REQUIRED, PolicySettings

OFF_VALUES = frozenset({"0", "false", "no", "off"})
ON_VALUES = frozenset({"1", "true", "yes", "on"})

DEFAULT_DRAFT_BLOCK_SIZE = 4
MIN_DRAFT_BLOCK_SIZE = 2  # K=1 would verify no drafts at all
MAX_DRAFT_BLOCK_SIZE = 32
MAX_PROFILE_SAMPLES = 1000


class ConfigError(ValueError):
    """A setting has a value mlxcel cannot use. ``str()`` is the one-line message."""

    def __init__(self, variable: str, value: str, accepted: str) -> None:
        super().__init__(f"{variable}={value!r} is not valid: expected {accepted}")
        self.variable = variable


@dataclass(frozen=True, slots=True)
class EnvConfig:
    """Everything the ``MLXCEL_*`` variables say."""

    policy: PolicySettings
    draft_block_size: int | None
    """``MLXCEL_DRAFT_BLOCK_SIZE``, or None when unset (``--draft-block-size`` or the default decides)."""
    cache_root: Path


def _get(env: Mapping[str, str], name: str) -> str | None:
    """The variable's value, or None when unset or empty (``VAR= cmd`` means unset)."""
    value = env.get(name, "").strip()
    return value or None


def _switch(env: Mapping[str, str], name: str, default: bool) -> bool:
    value = _get(env, name)
    if value is None:
        return default
    if value.lower() in OFF_VALUES:
        return False
    if value.lower() in ON_VALUES:
        return True
    raise ConfigError(name, value, "one of 1/true/yes/on or 0/false/no/off (any case)")


def _int(env: Mapping[str, str], name: str, low: int, high: int, what: str) -> int | None:
    value = _get(env, name)
    if value is None:
        return None
    return parse_int(name, value, low, high, what)


def parse_int(name: str, value: str, low: int, high: int, what: str) -> int:
    """*value* as an integer in [low, high], or a :class:`ConfigError` naming *name*."""
    try:
        number = int(value)
    except ValueError:
        number = low - 1
    if not low <= number <= high:
        raise ConfigError(name, value, f"an integer from {low} to {high} ({what})")
    return number


def parse_draft_block_size(name: str, value: str) -> int:
    return parse_int(name, value, MIN_DRAFT_BLOCK_SIZE, MAX_DRAFT_BLOCK_SIZE,
                     "the verify width K: K-1 drafts per round")


def load_env(env: Mapping[str, str] | None = None) -> EnvConfig:
    """Parse the ``MLXCEL_*`` variables of *env* (default: the process environment)."""
    env = os.environ if env is None else env
    pin_value = _get(env, "MLXCEL_ENABLE_MTP_B1")
    block = _get(env, "MLXCEL_DRAFT_BLOCK_SIZE")
    samples = _int(env, "MLXCEL_MTP_PROFILE_SAMPLES", 1, MAX_PROFILE_SAMPLES,
                   "qualifying samples per profiling window")
    cache = _get(env, "MLXCEL_CACHE_DIR")
    return EnvConfig(
        policy=PolicySettings(
            adaptive=_switch(env, "MLXCEL_MTP_ADAPTIVE", default=True),
            # Any set value pins: an off value pins off, anything else pins on.
            pin=None if pin_value is None else pin_value.lower() not in OFF_VALUES,
            allow_inexact=_switch(env, "MLXCEL_MTP_ALLOW_INEXACT", default=False),
            samples_required=samples if samples is not None else DEFAULT_SAMPLES_REQUIRED,
        ),
        draft_block_size=None if block is None else parse_draft_block_size("MLXCEL_DRAFT_BLOCK_SIZE", block),
        cache_root=Path(cache).expanduser() if cache else platformdirs.user_cache_path("mlxcel"),
    )
