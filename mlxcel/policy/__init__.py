"""The adaptive MTP policy: pure Python, no MLX, no trio, no HTTP.

Public surface: :class:`MtpPolicy` and the values it takes and publishes.
"""

from .estimator import (
    DECLINE,
    DECLINE_AT_OR_BELOW,
    ENABLE,
    ENABLE_AT_OR_ABOVE,
    BurstSample,
    Verdict,
)
from .hints import HINT_VERSION, Hint, HintStore, PairingKey
from .policy import (
    DEFAULT_SAMPLES_REQUIRED,
    UNKNOWN_HOST,
    BootFacts,
    HostInfo,
    MtpPolicy,
    PolicySettings,
)
from .snapshot import SCHEMA_VERSION, MtpPolicySnapshot

__all__ = [
    "DECLINE",
    "DECLINE_AT_OR_BELOW",
    "DEFAULT_SAMPLES_REQUIRED",
    "ENABLE",
    "ENABLE_AT_OR_ABOVE",
    "HINT_VERSION",
    "SCHEMA_VERSION",
    "UNKNOWN_HOST",
    "BootFacts",
    "BurstSample",
    "Hint",
    "HintStore",
    "HostInfo",
    "MtpPolicy",
    "MtpPolicySnapshot",
    "PairingKey",
    "PolicySettings",
    "Verdict",
]
