"""What a failed run does to a node: a fix that took it out hands it to a person."""

from __future__ import annotations

import pytest
from gpuops.catalog import load_catalog
from gpuops.models import RunStatus
from gpuops.record.nodestate import NodeRecord, NodeState, after_run

from tests.conftest import ROOT

CATALOG = load_catalog(ROOT / "playbooks")
TAKEN_OUT = NodeRecord(node="n1", state=NodeState.REMEDIATING, quarantined=True)
IN_SERVICE = NodeRecord(node="n1", state=NodeState.REMEDIATING, quarantined=False)
DRAIN_TIMEOUT = "drain of n1 failed after 300s; pods still on it: shop/web-0; kubectl: ..."


@pytest.mark.parametrize("playbook", ["reboot.yml", "gpu_reset.yml", "reprovision.yml"])
def test_a_failed_fix_that_took_the_node_out_goes_to_a_person_with_why(playbook: str) -> None:
    moved = after_run(TAKEN_OUT, playbook, RunStatus.FAILED, CATALOG, "r", 10.0, DRAIN_TIMEOUT)
    assert moved is not None and moved.state is NodeState.NEEDS_HUMAN
    assert moved.why == f"{playbook} failed: {DRAIN_TIMEOUT}"
    assert moved.quarantined, "it stays out of service"


def test_a_fix_cut_off_by_its_timeout_goes_to_a_person_without_an_error_text() -> None:
    moved = after_run(TAKEN_OUT, "reboot.yml", RunStatus.TIMEOUT, CATALOG, "r", 10.0)
    assert moved is not None and (moved.state, moved.why) == (
        NodeState.NEEDS_HUMAN,
        "reboot.yml timeout",
    )


def test_other_failures_still_step_back() -> None:
    drain = after_run(TAKEN_OUT, "drain.yml", RunStatus.FAILED, CATALOG, "r", 10.0, "x")
    assert drain is not None and drain.state is NodeState.QUARANTINED
    power = after_run(IN_SERVICE, "power_limit.yml", RunStatus.FAILED, CATALOG, "r", 10.0, "x")
    assert power is not None and power.state is NodeState.SUSPECT


@pytest.mark.parametrize("playbook", ["drain.yml", "return_to_service.yml", "reboot.yml"])
def test_a_node_a_person_holds_goes_to_a_person_whatever_the_playbook(playbook: str) -> None:
    held = (
        'n1 is held by a person: IDLE+DRAIN in Slurm for "alice: fan swap" (set by alice), '
        "not a reason of gpuops's; gpuops leaves it alone"
    )
    for record in (TAKEN_OUT, IN_SERVICE):
        moved = after_run(
            record, playbook, RunStatus.FAILED, CATALOG, "r", 10.0, held, "alice: fan swap"
        )
        assert moved is not None and moved.state is NodeState.NEEDS_HUMAN
        assert moved.why == f"{playbook} failed: {held}"


def test_words_in_a_failure_are_not_a_person_s_hold_only_the_run_s_signal_is() -> None:
    said = "the log says the node is held by a person, but no playbook found one"
    moved = after_run(TAKEN_OUT, "drain.yml", RunStatus.FAILED, CATALOG, "r", 10.0, said)
    assert moved is not None and moved.state is NodeState.QUARANTINED


def test_only_a_drain_decided_with_a_gate_validates_after_it() -> None:
    """A drain for a grade (decide.nodegate.DrainForGrade) validates, and the gate runs the
    grade; a person's drain of a node that still carries a failed gate's grade stays theirs."""
    left_out = TAKEN_OUT.model_copy(update={"grade": 2})
    mine = after_run(left_out, "drain.yml", RunStatus.SUCCESSFUL, CATALOG, "r", 10.0, gated=True)
    assert mine is not None and mine.state is NodeState.VALIDATING
    theirs = after_run(left_out, "drain.yml", RunStatus.SUCCESSFUL, CATALOG, "chatops-drain", 10.0)
    assert theirs is not None and theirs.state is NodeState.NEEDS_HUMAN
    assert "fix the cause, then undrain n1" in theirs.why
