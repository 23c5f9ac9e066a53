"""Budgets per failure domain: the live engine's stages on in-memory buckets."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from gpuops.bus.buckets import Buckets
from gpuops.clock import ManualClock
from gpuops.decide.domains import domain_store
from gpuops.inventory.domains import Domains
from gpuops.inventory.hosts import Inventory
from gpuops.match.loader import load_rules
from gpuops.match.rules import Rule
from gpuops.models import Reason
from gpuops.settings import DomainBudget, SafetySettings

from tests.unit.decide.helpers import ROOT, T0, engine_on, match

RULES = {r.name: r for r in load_rules([ROOT / "rules"], ROOT / "playbooks").rules}
REBOOT = RULES["xid-79-gpu-lost"]  # a reboot takes the node's capacity: budgets count it
NODES = [f"node-{i:03d}" for i in range(1, 17)]
# Racks r1..r4 of 4 nodes; cooling loops by group: loop-a cools r1 and r2, loop-b r3 and r4.
INVENTORY = Inventory(
    Path("inv"),
    frozenset(NODES),
    {
        "cooling_loop_a": frozenset(NODES[:8]),
        "cooling_loop_b": frozenset(NODES[8:]),
        "gpu": frozenset(NODES),
    },
    {n: {"rack": f"r{i // 4 + 1}"} for i, n in enumerate(NODES)},
)


def _engine(clock: ManualClock, buckets: Buckets | None = None, **budgets: Any) -> Any:
    return engine_on(
        clock, buckets, inventory=INVENTORY, domain_budgets=budgets or {"rack": {"nodes": 1}}
    )


async def _faults(engine: Any, nodes: list[str], t: float, rule: Rule = REBOOT) -> list[Any]:
    decider = engine.pipeline.decider
    return [await decider.decide(match(rule.name, n, t=t), rule) for n in nodes]


def test_domains_come_from_host_variables_and_from_groups_named_for_them() -> None:
    domains = Domains.of(INVENTORY)
    assert domains.of_node("node-001") == {"cooling_loop": "cooling_loop_a", "rack": "r1"}
    assert domains.of_node("node-016") == {"cooling_loop": "cooling_loop_b", "rack": "r4"}
    assert domains.size("rack", "r2") == 4 and domains.size("cooling_loop", "cooling_loop_a") == 8
    assert "gpu" not in domains.of_node("node-001"), "a group not named for a domain kind"


def test_a_budget_is_the_least_of_its_count_and_share_and_at_least_one() -> None:
    assert DomainBudget(nodes=2, share=0.5).limit(4) == 2
    assert DomainBudget(nodes=2, share=0.5).limit(2) == 1
    assert DomainBudget(share=0.25).limit(18) == 5
    assert DomainBudget(share=0.01).limit(8) == 1
    assert DomainBudget().limit(7) == 7, "neither set: the whole domain"
    defaults = SafetySettings().domain_budgets
    assert defaults["rack"].limit(4) == 2 and defaults["cooling_loop"].limit(8) == 2


async def test_three_faults_in_one_rack_let_one_through_and_another_rack_still_acts() -> None:
    clock = ManualClock(T0)
    engine = _engine(clock)
    same_rack = await _faults(engine, ["node-001", "node-002", "node-003"], T0)
    assert [d.reason for d in same_rack] == [Reason.ACCEPTED] + [Reason.DOMAIN_BUDGET] * 2
    for dropped in same_rack[1:]:
        assert "rack r1" in dropped.detail and "budget is 1" in dropped.detail
        assert "node-001" in dropped.detail, "the drop names who used the budget"
    other = await _faults(engine, ["node-005"], T0 + 1)
    assert other[0].accepted, "rack r2 has its own budget"
    clock.advance(601)  # the window passed: r1 may lose another node
    assert (await _faults(engine, ["node-004"], clock.now()))[0].accepted


async def test_a_loop_s_share_counts_across_its_racks_and_stops_the_third() -> None:
    clock = ManualClock(T0)
    engine = _engine(clock, cooling_loop={"share": 0.25}, rack={"nodes": 2})  # 8 nodes: 2
    got = await _faults(engine, ["node-001", "node-005", "node-006"], T0)
    assert [d.reason for d in got[:2]] == [Reason.ACCEPTED, Reason.ACCEPTED]
    assert got[2].reason is Reason.DOMAIN_BUDGET and "cooling_loop cooling_loop_a" in got[2].detail
    # The third's rack (r2) entry was taken back when the loop dropped it.
    r2, _ = await domain_store(engine.buckets.control).get("rack", "r2")
    assert r2 is not None and {e.node for e in r2.entries} == {"node-005"}
    assert (await _faults(engine, ["node-009"], T0 + 2))[0].accepted, "loop b is another"


async def test_what_takes_no_capacity_is_not_counted_and_a_redelivery_is_the_same_node() -> None:
    clock = ManualClock(T0)
    engine = _engine(clock)
    decider = engine.pipeline.decider
    first = match(REBOOT.name, "node-001", t=T0)
    assert (await decider.decide(first, REBOOT)).accepted
    assert (await decider.decide(first, REBOOT)).accepted, "the same event decided again"
    notify_only = RULES["thermal-throttle"]  # tells people, takes nothing away
    assert not any(a.playbook for a in notify_only.actions)
    told = await decider.decide(match(notify_only.name, "node-002", t=T0 + 1), notify_only)
    assert told.reason is not Reason.DOMAIN_BUDGET


async def test_a_later_stage_s_drop_takes_the_domain_entry_back() -> None:
    clock = ManualClock(T0)
    engine = engine_on(
        clock,
        inventory=INVENTORY,
        domain_budgets={"rack": {"nodes": 1}},
        breaker_share=0.01,
        breaker_absolute=1,
        breaker_floor=1,
    )
    got = await _faults(engine, ["node-001", "node-005"], T0)
    assert [d.reason for d in got] == [Reason.ACCEPTED, Reason.BREAKER_OPEN]
    r2, _ = await domain_store(engine.buckets.control).get("rack", "r2")
    assert r2 is None or r2.entries == (), "node-005 lost no capacity: r2 keeps its budget"


async def test_replicas_deciding_at_once_never_pass_more_than_the_budget() -> None:
    clock, shared = ManualClock(T0), Buckets.memory()
    replicas = [_engine(clock, shared).pipeline.decider for _ in range(4)]
    decided = await asyncio.gather(
        *(
            r.decide(match(REBOOT.name, node, t=T0), REBOOT)
            for r, node in zip(replicas, NODES[:4], strict=True)
        )
    )
    reasons = sorted(d.reason.value for d in decided)
    assert reasons == ["accepted"] + ["domain_budget"] * 3


@pytest.mark.parametrize("budgets", [{}, {"pdu": {"nodes": 1}}])
async def test_no_budget_for_the_node_s_domains_lets_every_fault_through(
    budgets: dict[str, Any],
) -> None:
    clock = ManualClock(T0)
    engine = engine_on(clock, inventory=INVENTORY, domain_budgets=budgets)
    got = await _faults(engine, NODES[:4], T0)
    assert all(d.accepted for d in got)
