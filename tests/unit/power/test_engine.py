"""The controller inside the engine (in-memory stores, the real stages and rules): changes
are decided like any action, audited with the budget, and other power rules yield."""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any

from gpuops.bus.buckets import Buckets
from gpuops.bus.publish import MemoryPublisher
from gpuops.catalog import load_catalog
from gpuops.clock import ManualClock
from gpuops.inventory.hosts import Inventory
from gpuops.match.loader import load_rules
from gpuops.models import EVENT_ADAPTER, Intent, Reason
from gpuops.power.budgets import BudgetOverride
from gpuops.power.engine import POWER_RULE
from gpuops.record.notify import Notifier
from gpuops.settings import Settings
from gpuops.sim.fleet import SimFleet
from gpuops.spine.build import Engine, build_engine

from tests.conftest import ROOT

NODES = ["node-001", "node-002"]
T0 = 1_767_225_600.0


class HalfOwned:
    """This replica owns node-001's partition; another replica owns node-002's."""

    def owns(self, node: str) -> bool:
        return node == "node-001"

    def shared_with_others(self, nodes: frozenset[str]) -> bool:
        return "node-002" in nodes


def _engine(
    tmp_path: Path,
    hostvars: dict[str, dict[str, Any]] | None = None,
    sharing: HalfOwned | None = None,
    inventory: Inventory | None = None,
) -> Engine:
    settings = Settings.model_validate(
        {"notifications": {"group_wait_s": 0}, "power": {"interval_s": 10}}
    )
    inventory = inventory or Inventory(
        tmp_path, frozenset(NODES), {"rack-a1": frozenset(NODES)}, hostvars or {}
    )
    return build_engine(
        settings,
        rules=load_rules([ROOT / "rules"], ROOT / "playbooks"),
        inventory=inventory,
        catalog=load_catalog(ROOT / "playbooks"),
        buckets=Buckets.memory(),
        publisher=MemoryPublisher(),
        clock=ManualClock(T0),
        signing_key=secrets.token_bytes(32),
        notifier=Notifier(),
        sharing=sharing,
    )


async def _feed(engine: Engine, fleet: SimFleet, t: float, nodes: list[str] = NODES) -> None:
    for node in nodes:
        event = EVENT_ADAPTER.validate_python(fleet.telemetry(node, t))
        await engine.pipeline.handle(event)


def _intents(engine: Engine) -> list[Intent]:
    publisher = engine.pipeline.publisher
    assert isinstance(publisher, MemoryPublisher)
    return [
        Intent.model_validate_json(p)
        for s, p in publisher.messages
        if s.startswith("gpuops.actions.")
    ]


async def _budget(engine: Engine, watts: float) -> None:
    await engine.power.overrides.set(
        BudgetOverride(group="rack-a1", watts=watts, starts=T0, ends=T0 + 3600, by="alice")
    )


async def test_a_budget_becomes_one_audited_per_gpu_intent_per_node(tmp_path: Path) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=2, gpus=4)
    for node in NODES:
        fleet.inject(node, "load", 0, workload="training")
    engine = _engine(tmp_path)
    await _feed(engine, fleet, T0)
    await _budget(engine, 4000.0)
    plan = await engine.power.step()
    intents = _intents(engine)
    assert sorted(i.node for i in intents) == NODES
    for intent in intents:
        assert intent.rule == POWER_RULE and intent.action.playbook == "power_limit.yml"
        limits = dict(p.split(":") for p in intent.action.vars["limits"].split(","))
        assert intent.gpus == (0, 1, 2, 3) and len(limits) == 4
        assert "override by alice" in intent.action.vars["reason"]
        facts = intent.decision.match.facts if intent.decision else {}
        assert facts["budgets"][0]["budget_w"] == 4000.0 and facts["allocation"]["0"]["from"] == 700
    assert (
        sum(
            float(w)
            for i in intents
            for w in i.action.vars["limits"].split(",")
            for w in [w.split(":")[1]]
        )
        <= 4000.0
    )
    assert plan.groups[0].allocation.feasible
    record, _ = await engine.power.records.get("node-001")
    assert record is not None and record.groups == ("rack-a1",)


async def test_power_limit_below_policy_leaves_a_budgeted_node_to_the_controller(
    tmp_path: Path,
) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=2, gpus=4)
    fleet.inject("node-001", "load", 0, workload="training")
    engine = _engine(tmp_path)
    await _feed(engine, fleet, T0)
    await _budget(engine, 3000.0)
    await engine.power.step()
    for change in _intents(engine):  # the runs happened: the nodes report the new limits
        for pair in change.action.vars["limits"].split(","):
            gpu, watts = pair.split(":")
            fleet.inject(change.node, "power_limit", int(gpu), watts=float(watts))
    decisions = []
    engine.pipeline.recorder.auditor.listeners.append(
        lambda r: decisions.append(r) if r.type == "decision" else None
    )
    for second in range(0, 45, 5):
        engine.pipeline.clock.set(T0 + second)  # type: ignore[attr-defined]
        await _feed(engine, fleet, T0 + second)
    below = [r for r in decisions if r.rule == "power-limit-below-policy"]
    assert below, "the rule still sees the lowered limits"
    assert {r.body["decision"]["reason"] for r in below} == {Reason.POWER_BUDGET.value}
    assert not [i for i in _intents(engine) if i.rule == "power-limit-below-policy"]


async def test_floors_above_the_budget_are_kept_and_a_person_is_asked(tmp_path: Path) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=2, gpus=4)
    for node in NODES:
        fleet.inject(node, "load", 0, workload="training")
    engine = _engine(tmp_path, {n: {"power_class": "guaranteed"} for n in NODES})
    await _feed(engine, fleet, T0)
    await _budget(engine, 4000.0)  # 8 GPUs x 650 W of floors = 5.2 kW
    plan = await engine.power.step()
    assert not plan.groups[0].feasible
    for intent in _intents(engine):
        watts = {float(p.split(":")[1]) for p in intent.action.vars["limits"].split(",")}
        assert watts == {650.0}, "the floors are kept, not the budget"
    told = [m for m in engine.notifier.sent if m["topic"] == "needs-human"]
    assert len(told) == 1 and "below the guaranteed floors" in told[0]["text"]
    assert "5.2 kW" in told[0]["text"] and "rack-a1" in told[0]["text"]
    await engine.power.step()
    assert len([m for m in engine.notifier.sent if m["topic"] == "needs-human"]) == 1, "once"
    assert json.dumps(plan.groups[0].allocation.floors_w) == "5200.0"


async def test_a_budget_split_between_replicas_is_not_kept_and_people_are_told(
    tmp_path: Path,
) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=2, gpus=4)
    for node in NODES:
        fleet.inject(node, "load", 0, workload="training")
    engine = _engine(tmp_path, sharing=HalfOwned())
    await _feed(engine, fleet, T0, ["node-001"])  # node-002's samples go to its owner
    await _budget(engine, 4000.0)
    await engine.power.step()
    await engine.power.step()
    assert _intents(engine) == [], "no limits from half the rack's draw"
    publisher = engine.pipeline.publisher
    assert isinstance(publisher, MemoryPublisher)
    notes = [
        json.loads(p)["summary"]
        for s, p in publisher.messages
        if s.startswith("gpuops.audit.") and "not kept" in json.loads(p)["summary"]
    ]
    assert len(notes) == 1 and "split between engine replicas" in notes[0]


async def test_a_facility_host_of_a_budgeted_group_is_not_a_node_it_waits_for(
    tmp_path: Path,
) -> None:
    """A CDU's controller in the rack's group (and the fleet) sends no GPU telemetry: a
    budget neither caps it nor waits for its draw before raising the rack's GPUs."""
    fleet = SimFleet.create(tmp_path / "sim", nodes=2, gpus=4)
    for node in NODES:
        fleet.inject(node, "load", 0, workload="training")
    inventory = Inventory(
        tmp_path,
        frozenset({*NODES, "cdu-a"}),
        {"rack-a1": frozenset({*NODES, "cdu-a"}), "facility": frozenset({"cdu-a"})},
        {},
    )
    engine = _engine(tmp_path, inventory=inventory)
    await _feed(engine, fleet, T0)
    await _budget(engine, 4000.0)
    plan = await engine.power.step()
    (group,) = plan.groups
    assert group.budget.nodes == frozenset(NODES) and group.unseen == ()
    assert sorted(i.node for i in _intents(engine)) == NODES
