"""One source of truth: the running machine and the committed diagram come from the same tables."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mlxcel import _docgen
from mlxcel.cli import main
from mlxcel.policy import MtpPolicy, PolicySettings
from mlxcel.policy import statechart as sc
from tests.conftest import ROOT


def test_committed_diagram_and_docs_are_fresh() -> None:
    assert _docgen.stale(ROOT) == [], "run `mlxcel statechart --write` (or `just statechart`) and commit"


def test_check_fails_on_a_stale_copy_and_write_repairs_it(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    for generated in (_docgen.DIAGRAM, _docgen.STATECHART_DOC):
        (tmp_path / generated).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / generated, tmp_path / generated)
    diagram = tmp_path / _docgen.DIAGRAM
    diagram.write_text(diagram.read_text().replace("record_sample", "record_samples"))
    assert main(["statechart", "--check", "--root", str(tmp_path)]) == 1
    assert "is stale" in capsys.readouterr().err
    assert main(["statechart", "--write", "--root", str(tmp_path)]) == 0
    assert main(["statechart", "--check", "--root", str(tmp_path)]) == 0


def test_diagram_draws_every_declared_arrow() -> None:
    diagram = sc.render_mermaid()
    for transition in sc.TRANSITIONS:
        sources = transition["source"] if isinstance(transition["source"], list) else [transition["source"]]
        dest = transition["dest"] or transition["source"]
        for source in sources:
            assert f"{source} --> {dest}: {transition['trigger']}" in diagram
    # Nothing but the declared triggers: no auto transitions (`to_<state>`) drawn.
    assert "to_" not in diagram


def test_the_running_machine_has_only_the_declared_triggers() -> None:
    policy = MtpPolicy(PolicySettings())
    machine = policy._machine
    for state in sc.LEAF_STATES:
        assert set(machine.get_triggers(state)) <= {"resolve", "record_sample", "lose_worker"}
    assert not hasattr(policy, "to_profiling")


def test_every_named_condition_exists_and_is_documented() -> None:
    named = {t[k] for t in sc.TRANSITIONS for k in ("conditions", "unless", "before") if k in t}
    assert named <= set(sc.CONDITIONS) | {"settle"}
    for name in named:
        assert callable(getattr(MtpPolicy, name)), name


def test_precedence_table_lists_the_boot_rows_in_order() -> None:
    rows = [line for line in sc.render_precedence_table().splitlines() if line[:3] in {f"| {i}" for i in
                                                                                        range(1, 8)}]
    dests = [row.rsplit("`", 2)[-2] for row in rows]
    assert dests == ["unavailable/no_mtp_dispatch", "unavailable/sharded", "unavailable/adaptive_disabled",
                     "forced", "exactness_declined", "settled", "profiling"]
    assert rows[-1].startswith("| 7 | otherwise |")
