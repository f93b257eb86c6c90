"""The adaptive MTP policy statechart, declared once, as data.

Everything about *which* state follows *which* event lives here: the running
policy (:mod:`mlxcel.policy.policy`) builds its machine from these tables, and
``mlxcel statechart`` renders the committed diagram from the very same tables,
so the two cannot drift apart.

Conditions and callbacks are named by string; they are methods of the model the
machine drives (the policy), and :data:`CONDITIONS` says in words what each one
checks, for the generated docs.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from transitions.extensions import HierarchicalGraphMachine, HierarchicalMachine
from transitions.extensions.nesting import NestedState

#: Separator between a parent state and its child. The library's default, ``_``,
#: would split ``exactness_declined`` into two states.
SEPARATOR = "/"

# The five states of the contract (mtp-policy-api.md, "States").
UNAVAILABLE = "unavailable"
PROFILING = "profiling"
SETTLED = "settled"
FORCED = "forced"
EXACTNESS_DECLINED = "exactness_declined"

# The reasons of the ``unavailable`` state, modelled as its children so that
# every reason is a real state with its own arrows. The contract lets the set
# grow within a schema version: ``sharded`` came with ``--distributed``.
WORKER_NOT_READY = "worker_not_ready"
NO_MTP_DISPATCH = "no_mtp_dispatch"
SHARDED = "sharded"
ADAPTIVE_DISABLED = "adaptive_disabled"
REASONS = (WORKER_NOT_READY, NO_MTP_DISPATCH, SHARDED, ADAPTIVE_DISABLED)

STATES: list[Any] = [
    {"name": UNAVAILABLE, "children": list(REASONS), "initial": WORKER_NOT_READY},
    PROFILING,
    SETTLED,
    FORCED,
    EXACTNESS_DECLINED,
]


def unavailable(reason: str) -> str:
    """The full name of the ``unavailable`` child state for *reason*."""
    return f"{UNAVAILABLE}{SEPARATOR}{reason}"


INITIAL = unavailable(WORKER_NOT_READY)

#: Every state a policy can be in, leaves only, in declaration order.
LEAF_STATES = (*(unavailable(r) for r in REASONS), PROFILING, SETTLED, FORCED, EXACTNESS_DECLINED)

# Boot resolution. The worker fires ``resolve`` once it has loaded the model;
# the library tries these arrows top to bottom and takes the first whose
# conditions hold, which is exactly the precedence table of the architecture
# (section 4): first match wins.
BOOT_PRECEDENCE: list[dict[str, Any]] = [
    {"trigger": "resolve", "source": INITIAL, "dest": unavailable(NO_MTP_DISPATCH),
     "conditions": "lacks_mtp_dispatch"},
    {"trigger": "resolve", "source": INITIAL, "dest": unavailable(SHARDED),
     "conditions": "runs_sharded"},
    {"trigger": "resolve", "source": INITIAL, "dest": unavailable(ADAPTIVE_DISABLED),
     "conditions": "adaptive_is_off"},
    {"trigger": "resolve", "source": INITIAL, "dest": FORCED,
     "conditions": "operator_pinned"},
    {"trigger": "resolve", "source": INITIAL, "dest": EXACTNESS_DECLINED,
     "conditions": "probe_vetoed", "unless": "inexact_allowed"},
    {"trigger": "resolve", "source": INITIAL, "dest": SETTLED,
     "conditions": "hint_restored"},
    {"trigger": "resolve", "source": INITIAL, "dest": PROFILING},
]

TRANSITIONS: list[dict[str, Any]] = [
    *BOOT_PRECEDENCE,
    # A qualifying sample either fills the window, which settles the verdict
    # (and persists it), or leaves the policy measuring.
    {"trigger": "record_sample", "source": PROFILING, "dest": SETTLED,
     "conditions": "window_full", "before": "settle"},
    {"trigger": "record_sample", "source": PROFILING, "dest": None},
    # The worker died or restarts: nothing is known until it resolves again.
    {"trigger": "lose_worker",
     "source": [s for s in LEAF_STATES if s != INITIAL], "dest": INITIAL},
]

#: What each named condition checks, in the words the docs use.
CONDITIONS: dict[str, str] = {
    "lacks_mtp_dispatch": "no MTP dispatch: no drafter, a drafter of another "
    "speculative kind, or a worker with no MTP path (`--no-batch`)",
    "runs_sharded": "the model is sharded across processes (`--distributed`), where the burst cannot run",
    "adaptive_is_off": "`MLXCEL_MTP_ADAPTIVE` is off",
    "operator_pinned": "`MLXCEL_ENABLE_MTP_B1` is set (an operator pin)",
    "probe_vetoed": "the exactness probe vetoed the pairing",
    "inexact_allowed": "`MLXCEL_MTP_ALLOW_INEXACT` is on",
    "hint_restored": "a valid persisted hint exists for this exact pairing key",
    "window_full": "the profiling window holds `samples_required` samples",
}


class _State(NestedState):
    separator = SEPARATOR


class _Machine(HierarchicalMachine):
    state_cls = _State


class _GraphMachine(HierarchicalGraphMachine):
    state_cls = _State


def build_machine(model: object) -> HierarchicalMachine:
    """A fresh machine over *model*, which must provide the named conditions.

    ``auto_transitions=False``: the only arrows are the ones declared above.
    ``finalize_event`` runs after every event, also one that changed nothing,
    so the model can publish a snapshot each time.
    """
    return _Machine(
        model=model,
        states=STATES,
        transitions=TRANSITIONS,
        initial=INITIAL,
        auto_transitions=False,
        finalize_event="publish",
    )


def render_mermaid() -> str:
    """The statechart as mermaid source, from a fresh machine (no state highlighted)."""
    machine = _GraphMachine(
        model=SimpleNamespace(),
        states=STATES,
        transitions=TRANSITIONS,
        initial=INITIAL,
        auto_transitions=False,
        graph_engine="mermaid",
        show_conditions=True,
        title="mlxcel adaptive MTP policy",
    )
    source: str = machine.get_graph().draw(None)
    # One trailing newline, so the committed file is stable under editors.
    return source.rstrip() + "\n"


def _describe(transition: dict[str, Any]) -> str:
    text = CONDITIONS[transition["conditions"]] if "conditions" in transition else "otherwise"
    if "unless" in transition:
        text += f", unless {CONDITIONS[transition['unless']]}"
    return text


def render_precedence_table() -> str:
    """The boot precedence table, in markdown, from :data:`BOOT_PRECEDENCE`."""
    rows = ["| # | When (first match wins) | State |", "|---|---|---|"]
    for number, transition in enumerate(BOOT_PRECEDENCE, start=1):
        rows.append(f"| {number} | {_describe(transition)} | `{transition['dest']}` |")
    return "\n".join(rows) + "\n"
