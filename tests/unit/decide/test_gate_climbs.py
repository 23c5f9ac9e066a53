"""The gate back into service, in the live engine's stages: a rule's `gate` is the grade
the return runs after its fix, and a failed gate is decided as its fault again, so the
fault's ladder takes its next rung though the fault's cooldown still runs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gpuops import subjects
from gpuops.act.completion import Completion
from gpuops.bus.buckets import Buckets
from gpuops.bus.publish import MemoryPublisher
from gpuops.bus.store import MemoryKV
from gpuops.clock import ManualClock
from gpuops.diagnose.results import Check, GradeResult
from gpuops.match.loader import load_rules
from gpuops.match.rules import RuleSet
from gpuops.models import (
    EVENT_ADAPTER,
    Decision,
    Intent,
    Reason,
    RunOutcome,
    RunStatus,
)
from gpuops.record.nodestate import NodeState, fault_key, validation_nonce
from gpuops.spine import pipeline
from gpuops.spine.build import Engine

from tests.support import decide
from tests.unit.decide.helpers import ROOT, T0, engine_on, match

RULES = load_rules([ROOT / "rules"], ROOT / "playbooks")
SLOW = GradeResult(
    grade=2,
    checks=(
        Check(name="dcgm:Memory bandwidth", ok=True),
        Check(
            name="nvbandwidth:device_to_device_memcpy_read_ce",
            ok=False,
            value=120.0,
            expect=">= 335",
            unit="GB/s",
            gpu=1,
        ),
    ),
)
PASSED = GradeResult(grade=2, checks=(Check(name="dcgm:Memory bandwidth", ok=True),))


class Fleet:
    """The engine, and the executor's side of each run: it ends as the test says."""

    def __init__(self, rules: RuleSet = RULES, buckets: Buckets | None = None) -> None:
        self.clock = ManualClock(T0)
        self.publisher = MemoryPublisher()
        self.engine: Engine = engine_on(self.clock, buckets, rules=rules, publisher=self.publisher)
        self.told: list[dict[str, Any]] = []
        self.asked: list[str] = []
        self.completion = Completion(
            self.engine.recorder,
            self.engine.locks,
            self._ask,
            self.engine.recorder.catalog,
            self._tell,
        )
        self._ran = 0

    async def _ask(self, node: str, nonce: str) -> None:
        self.asked.append(nonce)

    async def _tell(self, event: dict[str, Any]) -> None:
        self.told.append(event)

    async def run(self, status: RunStatus, grade: GradeResult | None = None) -> Intent:
        """The one new intent runs and ends with `status` (and the grade it measured)."""
        new = [p for s, p in self.publisher.messages[self._ran :] if subjects.is_action(s)]
        self._ran = len(self.publisher.messages)
        [payload] = new
        intent = Intent.model_validate_json(payload)
        self.clock.advance(60)
        await self.completion.started(intent)
        self.clock.advance(60)
        outcome = RunOutcome.of(intent, status, self.clock.now() - 60, self.clock.now())
        await self.completion.ended(intent, outcome.model_copy(update={"grade": grade}))
        return intent

    async def probe_passes(self) -> Decision:
        record = await self.engine.states.get("node-001")
        nonce = validation_nonce(record)
        probe = match(
            "validation-passed", t=self.clock.now(), gpu=None, kind="probe", outcome="pass"
        )
        probe = probe.model_copy(update={"facts": {**probe.facts, "nonce": nonce}})
        return await decide(self.engine.pipeline, probe)

    async def state(self) -> NodeState:
        return (await self.engine.states.get("node-001")).state


async def test_a_failed_gate_climbs_the_fault_s_ladder_and_the_next_gate_passes() -> None:
    fleet = Fleet()
    xid = match("xid-79-gpu-lost", gpu=None, xid=79)
    first = await decide(fleet.engine.pipeline, xid)
    assert first.accepted and [a.playbook for a in first.actions] == ["reboot.yml"]
    assert first.gate == 2, "the rule's gate: grade 2 after a GPU fell off the bus"
    assert (await fleet.engine.states.get("node-001")).grade == 2

    await fleet.run(RunStatus.SUCCESSFUL)
    assert await fleet.state() is NodeState.VALIDATING
    back = await fleet.probe_passes()
    assert back.accepted and back.actions[0].playbook == "return_to_service.yml"
    assert back.actions[0].vars["grade"] == 2, "the fault's grade, deeper than the site's 1"

    await fleet.run(RunStatus.FAILED, SLOW)
    record = await fleet.engine.states.get("node-001")
    assert record.state is NodeState.QUARANTINED, "a failed gate keeps the node out"
    [told] = fleet.told
    assert told["kind"] == "diagnostics" and told["data"]["gate"] is True
    assert told["data"]["fault_rule"] == "xid-79-gpu-lost"
    assert told["data"]["fault_key"] == fault_key(record) == xid.key
    assert told["data"]["failed"] == "nvbandwidth:device_to_device_memcpy_read_ce"
    assert told["data"]["value"] == 120.0

    # Minutes after the reboot: XID 79's 1h cooldown runs, yet the gate climbs.
    [climbed] = await fleet.engine.pipeline.handle(EVENT_ADAPTER.validate_python(told))
    assert climbed.match.rule == "xid-79-gpu-lost" and climbed.match.kind == "gate"
    assert climbed.accepted, climbed
    assert [a.playbook for a in climbed.actions] == ["reprovision.yml"], "rung 2"
    assert climbed.rung == 1 and climbed.gate == 2
    assert await fleet.state() is NodeState.QUARANTINED

    again = match("xid-79-gpu-lost", t=fleet.clock.now(), gpu=None, event_id="x2")
    recurrence = await decide(fleet.engine.pipeline, again)
    assert recurrence.reason is Reason.COOLDOWN, "a real recurrence is still held"

    await fleet.run(RunStatus.SUCCESSFUL)  # the reprovisioning
    back = await fleet.probe_passes()
    assert back.accepted and back.actions[0].vars["grade"] == 2
    await fleet.run(RunStatus.SUCCESSFUL, PASSED)
    record = await fleet.engine.states.get("node-001")
    assert record.state is NodeState.HEALTHY and record.grade == 0
    assert [t["data"]["ok"] for t in fleet.told] == [False, True]


async def test_a_gate_failing_after_the_last_rung_hands_the_node_to_a_person() -> None:
    fleet = Fleet()
    await decide(fleet.engine.pipeline, match("xid-79-gpu-lost", gpu=None))
    for _ in range(2):  # reboot, then reprovision: each gate fails
        await fleet.run(RunStatus.SUCCESSFUL)
        await fleet.probe_passes()
        await fleet.run(RunStatus.FAILED, SLOW)
        [d] = await fleet.engine.pipeline.handle(EVENT_ADAPTER.validate_python(fleet.told[-1]))
    assert d.reason is Reason.NEEDS_HUMAN and "ladder gpu-lost" in d.detail, d
    assert await fleet.state() is NodeState.NEEDS_HUMAN


class _HistoryTimingOut(MemoryKV):
    """The history bucket (ladders, attempts), whose next write times out after `meanwhile`
    ran (the executor starting the intent the decision has stored)."""

    meanwhile: Any = None

    async def cas(self, key: str, value: bytes, revision: int) -> int | None:
        if self.meanwhile is not None:
            meanwhile, self.meanwhile = self.meanwhile, None
            await meanwhile()
            raise TimeoutError("nats: timeout")
        return await super().cas(key, value, revision)


async def test_a_climb_decided_again_after_its_run_began_keeps_its_rung(
    monkeypatch: Any,
) -> None:
    """Review of issue 30: a failed gate's climb stored the next rung's intent, then the
    ladder's write timed out; the executor began the run meanwhile (the node remediating),
    and decided again the climb was dropped as not for a remediating node: the rung was
    never counted, the lock kept its pending minute, and the next failed gate ran the same
    rung again rather than handing the node to a person. The node's record names the
    decision that moved it: decided again, it goes through as it first did."""
    monkeypatch.setattr(pipeline, "DECIDE_PAUSE_S", 0.0)
    history = _HistoryTimingOut("history")
    fleet = Fleet(buckets=replace(Buckets.memory(), history=history))
    await decide(fleet.engine.pipeline, match("xid-79-gpu-lost", gpu=None, xid=79))
    await fleet.run(RunStatus.SUCCESSFUL)  # reboot
    await fleet.probe_passes()
    await fleet.run(RunStatus.FAILED, SLOW)  # its gate fails

    async def run_begins() -> None:
        [payload] = [p for s, p in fleet.publisher.messages[fleet._ran :] if subjects.is_action(s)]
        await fleet.completion.started(Intent.model_validate_json(payload))

    history.meanwhile = run_begins
    [climbed] = await fleet.engine.pipeline.handle(EVENT_ADAPTER.validate_python(fleet.told[-1]))
    assert climbed.accepted and climbed.rung == 1, climbed
    assert await fleet.state() is NodeState.REMEDIATING, "as its run left it"
    lock, _ = await fleet.engine.locks.holder("node-001")
    assert lock is not None and lock.until - fleet.clock.now() == 1800, "the full lease"
    ran = await fleet.run(RunStatus.SUCCESSFUL)
    assert ran.action.playbook == "reprovision.yml"
    await fleet.probe_passes()
    await fleet.run(RunStatus.FAILED, SLOW)  # the last rung's gate fails too
    [d] = await fleet.engine.pipeline.handle(EVENT_ADAPTER.validate_python(fleet.told[-1]))
    assert d.reason is Reason.NEEDS_HUMAN and "ladder gpu-lost" in d.detail, d
    assert await fleet.state() is NodeState.NEEDS_HUMAN


async def test_a_failed_gate_of_a_fault_with_no_ladder_goes_to_a_person() -> None:
    fleet = Fleet()
    d = await decide(fleet.engine.pipeline, match("probe-failed", gpu=0, kind="probe"))
    assert d.accepted and [a.playbook for a in d.actions] == ["gpu_reset.yml"]
    await fleet.run(RunStatus.SUCCESSFUL)
    await fleet.probe_passes()
    await fleet.run(RunStatus.FAILED, SLOW)
    [gate] = await fleet.engine.pipeline.handle(EVENT_ADAPTER.validate_python(fleet.told[-1]))
    assert gate.match.rule == "gate-failed" and gate.reason is Reason.NEEDS_HUMAN
    assert "nvbandwidth device_to_device_memcpy_read_ce GPU 1 120.0 GB/s" in gate.detail
    assert await fleet.state() is NodeState.NEEDS_HUMAN


async def test_a_gate_result_for_a_node_in_service_decides_nothing() -> None:
    """A told gate failure that finds the node healthy (a person undrained it since) is
    for no validation: nothing acts on it."""
    fleet = Fleet()
    data = {"grade": 2, "ok": False, "gate": True, "fault_rule": "xid-79-gpu-lost"}
    event = {
        "id": "d1",
        "kind": "diagnostics",
        "node": "node-001",
        "ts": "2027-01-15T08:00:00Z",
        "source": "gpuops-executor",
        "data": data,
    }
    fleet.clock.set(EVENT_ADAPTER.validate_python(event).epoch)
    decisions = await fleet.engine.pipeline.handle(EVENT_ADAPTER.validate_python(event))
    assert [d.reason for d in decisions] == [Reason.NOT_APPLICABLE]
    assert await fleet.state() is NodeState.HEALTHY


BUNDLE = GradeResult(
    grade=5,
    checks=(
        Check(name="bundle:directory", ok=True, detail="/var/lib/gpuops/diag/node-001/service-x"),
        Check(name="bundle:nvidia-bug-report", ok=True, value=48213.0, unit="bytes"),
        Check(name="bundle:bmc-sel", ok=False, detail="the node has no BMC (bmc: none)"),
    ),
)


async def test_grade_5_collects_the_bundle_then_hands_the_node_to_a_person(tmp_path: Any) -> None:
    rules_dir = tmp_path / "rules"
    rules_dir.mkdir()
    (rules_dir / "bundle.yml").write_text(
        "rules:\n  - name: xid-79-bundle\n    on: xid\n    when: xid == 79\n"
        "    group_by: [node]\n    actions:\n      - diagnose: 5\n"
    )
    fleet = Fleet(load_rules([rules_dir], ROOT / "playbooks"))
    asked = await decide(fleet.engine.pipeline, match("xid-79-bundle", gpu=None, xid=79))
    [action] = asked.actions
    assert (action.playbook, action.vars["grade"]) == ("diagnose.yml", 5)
    await fleet.run(RunStatus.SUCCESSFUL, BUNDLE)
    told = fleet.told[-1]
    assert told["data"]["grade"] == 5 and not told["data"]["gate"]
    [handoff] = await fleet.engine.pipeline.handle(EVENT_ADAPTER.validate_python(told))
    assert handoff.match.rule == "service-handoff" and handoff.reason is Reason.NEEDS_HUMAN
    assert "service bundle at /var/lib/gpuops/diag/node-001/service-x" in handoff.detail
    assert "(1 of 2 parts); missing: bmc-sel" in handoff.detail
    assert await fleet.state() is NodeState.NEEDS_HUMAN


def _slow_node_rules(tmp_path: Any) -> RuleSet:
    rules_dir = tmp_path / "rules"
    rules_dir.mkdir()
    (rules_dir / "slow.yml").write_text(
        "rules:\n  - name: looks-slow\n    on: xid\n    when: xid == 79\n"
        "    group_by: [node]\n    actions:\n      - diagnose: 2\n"
    )
    return load_rules([rules_dir, ROOT / "rules"], ROOT / "playbooks")


async def test_a_medium_grade_asked_for_a_node_in_service_drains_it_and_is_the_gate_back(
    tmp_path: Any,
) -> None:
    fleet = Fleet(_slow_node_rules(tmp_path))
    asked = await decide(fleet.engine.pipeline, match("looks-slow", gpu=None, xid=79))
    assert asked.accepted and [a.playbook for a in asked.actions] == ["drain.yml"], asked
    assert asked.gate == 2 and asked.holds_lock
    assert asked.actions[0].vars["reason"] == "grade 2 diagnostics (looks-slow)"
    record = await fleet.engine.states.get("node-001")
    assert (record.state, record.grade) == (NodeState.QUARANTINED, 2)
    breaker, _ = await fleet.engine.breaker.get()
    assert "node-001" in breaker.recent(fleet.clock.now(), 600), "the drain counts"
    again = await decide(fleet.engine.pipeline, match("looks-slow", gpu=None, xid=79))
    assert [a.playbook for a in again.actions] == ["drain.yml"] and again.holds_lock, (
        "the same event decided again after a crash is the same drain, not a second run"
    )

    await fleet.run(RunStatus.SUCCESSFUL)  # drained
    assert await fleet.state() is NodeState.VALIDATING
    back = await fleet.probe_passes()
    [ret] = back.actions
    assert (ret.playbook, ret.vars["grade"]) == ("return_to_service.yml", 2)
    assert ret.timeout_s == 600 + 1800, "the return's own 10 minutes and grade 2's 30"
    await fleet.run(RunStatus.SUCCESSFUL, PASSED)
    assert await fleet.state() is NodeState.HEALTHY, "the grade passed: back in service"


async def test_a_medium_grade_that_fails_after_its_drain_goes_to_a_person(tmp_path: Any) -> None:
    fleet = Fleet(_slow_node_rules(tmp_path))
    await decide(fleet.engine.pipeline, match("looks-slow", gpu=None, xid=79))
    await fleet.run(RunStatus.SUCCESSFUL)
    await fleet.probe_passes()
    await fleet.run(RunStatus.FAILED, SLOW)
    [gate] = await fleet.engine.pipeline.handle(EVENT_ADAPTER.validate_python(fleet.told[-1]))
    assert gate.match.rule == "gate-failed" and gate.reason is Reason.NEEDS_HUMAN, gate
    assert "120.0 GB/s" in gate.detail
    assert await fleet.state() is NodeState.NEEDS_HUMAN


async def test_a_medium_grade_on_a_node_already_out_runs_as_asked(tmp_path: Any) -> None:
    fleet = Fleet(_slow_node_rules(tmp_path))
    out = fleet.engine.states.store.model(node="node-001", state="quarantined", quarantined=True)
    await fleet.engine.states.store.put(out, "node-001")
    asked = await decide(fleet.engine.pipeline, match("looks-slow", gpu=None, xid=79))
    [action] = asked.actions
    assert (action.playbook, action.vars["grade"], asked.gate) == ("diagnose.yml", 2, 0)
