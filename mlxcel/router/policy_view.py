"""A serving node's MTP policy, read as the contract tells a consumer to (docs/mtp-policy-api.md).

- unknown fields are ignored;
- an unrecognised ``state`` or ``verdict`` label is "no verdict", never an error;
- a body whose ``schema_version`` is not one this reader knows is unreadable: nothing in it is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: The wire schema versions this reader understands.
KNOWN_SCHEMA_VERSIONS = frozenset({1})
KNOWN_STATES = frozenset({"settled", "profiling", "forced", "unavailable", "exactness_declined"})
KNOWN_VERDICTS = frozenset({"enable", "decline"})


@dataclass(frozen=True, slots=True)
class PolicyView:
    """What the router may use of one node's policy body."""

    readable: bool
    """False when the body could not be fetched, was not a JSON object, or had an unknown schema_version."""
    state: str | None = None
    """A known state label, or None (unreadable, or a label this reader does not know)."""
    verdict: str | None = None
    """``enable`` or ``decline`` when the state is ``settled`` and the label is known; else None."""
    mtp_enabled: bool | None = None

    @property
    def runs_burst(self) -> bool:
        """Whether a lone request on this node runs the B=1 MTP burst, as far as the body says.

        A measured ``enable`` verdict, or an operator pin that resolved to on
        (``forced`` with ``mtp_enabled: true``): a pin is not a verdict, but it does
        decide that the burst runs. Profiling is not counted: there is no verdict yet.
        """
        return (self.state == "settled" and self.verdict == "enable") or (
            self.state == "forced" and self.mtp_enabled is True)

    def label(self) -> str:
        """The state as /router/stats shows it."""
        if not self.readable:
            return "unreadable"
        return self.state or "unrecognised"


UNREADABLE = PolicyView(readable=False)


def read_policy(body: Any) -> PolicyView:
    """The view of a parsed ``/v1/internal/mtp-policy`` body (any JSON value)."""
    if not isinstance(body, dict):
        return UNREADABLE
    version = body.get("schema_version")
    # bool is an int in Python; a JSON true is not schema version 1.
    if type(version) is not int or version not in KNOWN_SCHEMA_VERSIONS:
        return UNREADABLE
    state = body.get("state")
    if not isinstance(state, str) or state not in KNOWN_STATES:
        return PolicyView(readable=True)
    verdict = body.get("verdict")
    known_verdict = verdict if state == "settled" and isinstance(verdict, str) and verdict in KNOWN_VERDICTS \
        else None
    enabled = body.get("mtp_enabled")
    return PolicyView(readable=True, state=state, verdict=known_verdict,
                      mtp_enabled=enabled if isinstance(enabled, bool) else None)
