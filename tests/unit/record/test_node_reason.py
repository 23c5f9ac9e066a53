"""The reason people see for a node's state: the GPU, and the strongest fault first."""

from __future__ import annotations

from gpuops.catalog import load_catalog
from gpuops.models import ActionSpec, Decision, Match, Reason
from gpuops.record.episodes import Episode, node_reason, strongest
from gpuops.record.nodestate import NodeRecord, NodeState, after_decision

from tests.conftest import ROOT

CATALOG = load_catalog(ROOT / "playbooks")


def _match(rule: str, gpus: tuple[int, ...] = (), severity: str = "warning") -> Match:
    return Match(
        rule=rule, kind="xid", node="n1", gpus=gpus, key="n1", event_id="e", event_ts=1.0,
        at=1.0, severity=severity,
    )  # fmt: skip


def _episode(rule: str, severity: str, opened: float, gpus: tuple[int, ...] = ()) -> Episode:
    return Episode(
        rule=rule, node="n1", level="gpu" if gpus else "node", severity=severity, gpus=gpus,
        detected_at=opened, opened_at=opened, last_seen=opened,
    )  # fmt: skip


def test_the_state_a_decision_sets_names_its_gpus() -> None:
    reboot = Decision(
        match=_match("xid-79-gpu-lost", (3,), "critical"),
        accepted=True,
        reason=Reason.ACCEPTED,
        actions=(ActionSpec(playbook="reboot.yml"),),
    )
    moved = after_decision(NodeRecord(node="n1"), reboot, CATALOG, 5.0)
    assert moved is not None and moved.state is NodeState.QUARANTINED
    assert (moved.why, moved.rule) == ("xid-79-gpu-lost on GPU 3: reboot.yml", "xid-79-gpu-lost")
    silent = Decision(match=_match("agent-silent"), accepted=False, reason=Reason.NO_ACTION)
    moved = after_decision(NodeRecord(node="n1"), silent, CATALOG, 5.0)
    assert moved is not None and (moved.state, moved.why) == (NodeState.SUSPECT, "agent-silent")


def test_a_gpu_off_the_bus_outranks_the_silent_agent_it_may_have_caused() -> None:
    silent = _episode("agent-silent", "warning", 10.0)
    lost = _episode("xid-79-gpu-lost", "critical", 20.0, (3,))
    assert strongest([silent, lost]) is lost, "severity first, though it opened later"
    older = _episode("probe-failed", "critical", 5.0, (1,))
    assert strongest([silent, lost, older]) is older, "between equals, the first"
    assert strongest([]) is None
    record = NodeRecord(node="n1", state=NodeState.SUSPECT, why="agent-silent", rule="agent-silent")
    assert (
        node_reason(record, [silent, lost])
        == "xid-79-gpu-lost on GPU 3 (critical); also agent-silent"
    )
    assert node_reason(record, [silent]) == "agent-silent", "its own fault: the why as it is"
    elsewhere = lost.model_copy(update={"node": "n2"})
    assert node_reason(record, [silent, elsewhere]) == "agent-silent", "another node's fault"
