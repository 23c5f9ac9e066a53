"""Domain correlation: many nodes of one cooling loop overheating at once are the loop's
fault. The shipped rules through the shadow engine (the live engine's code on memory
stores), fed what the simulated fleet's agents send."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from gpuops.bus.store import MemoryKV
from gpuops.decide.correlate import DomainCorrelation, DomainEpisode, correlation_store
from gpuops.decide.stage import Drop, Proposal
from gpuops.errors import RuleError
from gpuops.inventory.domains import Domains
from gpuops.inventory.hosts import Inventory
from gpuops.match.loader import load_rules
from gpuops.models import EVENT_ADAPTER, ActionSpec, Decision, Reason
from gpuops.power.budgets import Overrides
from gpuops.settings import Settings
from gpuops.sim.fleet import SimFleet
from gpuops.spine.shadow import Shadow

from tests.unit.decide.helpers import ROOT, match

T0 = 1_900_000_000.0
STEP_S = 5.0
NODES = [f"node-{i:03d}" for i in range(1, 11)]
LOOP_A, LOOP_B = NODES[:8], NODES[8:]
HOT_A = {"node-001": 0.0, "node-003": 10.0, "node-005": 25.0, "node-007": 40.0}
HOT_B = {"node-009": 0.0}


def _shadow() -> Shadow:
    settings = Settings.model_validate(
        {"rules_dir": ROOT / "rules", "playbooks_dir": ROOT / "playbooks"}
    )
    hostvars = {n: {"rack": f"r{i // 2 + 1}"} for i, n in enumerate(NODES)}
    groups = {"cooling_loop_a": frozenset(LOOP_A), "cooling_loop_b": frozenset(LOOP_B)}
    return Shadow(
        load_rules([ROOT / "rules"], ROOT / "playbooks"), NODES, settings, None, hostvars, groups
    )


async def _run(tmp_path: Path, hot: dict[str, float], minutes: float) -> tuple[Shadow, list[Any]]:
    """The fleet's samples every 5 s for `minutes`, `hot` nodes' GPU 2 overheating from
    their offset (the sim's cooling fault: the core climbs to 93 C over 30 s)."""
    fleet = SimFleet.create(tmp_path / "sim", nodes=len(NODES), gpus=4)
    for node in NODES:
        fleet.inject(node, "load", 0, workload="training")
    shadow, decisions = _shadow(), []
    for step in range(int(minutes * 60 / STEP_S)):
        t = T0 + step * STEP_S
        for node, offset in hot.items():
            if step * STEP_S == offset:
                fleet.inject(node, "overheat", 2, at=t)
        for node in NODES:
            sample = fleet.telemetry(node, t)
            if sample is not None:
                decisions += await shadow.feed(EVENT_ADAPTER.validate_python(sample))
    return shadow, decisions


def _drains(decisions: list[Decision]) -> set[str]:
    return {
        d.match.node
        for d in decisions
        if d.accepted and any(a.playbook == "drain.yml" for a in d.actions)
    }


def test_four_nodes_of_one_loop_are_one_domain_episode_and_a_fifth_elsewhere_is_drained(
    tmp_path: Path,
) -> None:
    shadow, decisions = asyncio.run(_run(tmp_path, {**HOT_A, **HOT_B}, minutes=4))
    overheat = [d for d in decisions if d.match.rule == "gpu-overheat"]
    assert _drains(overheat) == {"node-009"}, "loop b's one hot node is its own fault"
    held = {d.match.node for d in overheat if d.reason is Reason.DOMAIN_HELD}
    assert held == set(HOT_A), "loop a's four nodes are held by the loop's episode"
    opened = [d for d in overheat if d.detail.startswith("opened: ")]
    assert len(opened) == 1 and "cooling_loop cooling_loop_a" in opened[0].detail
    waited = [d for d in overheat if d.reason is Reason.DOMAIN_WAIT]
    assert {d.match.node for d in waited} >= {"node-001", "node-009"}

    async def stored() -> tuple[Any, Any, Any]:
        control = shadow.engine.buckets.control
        a, _ = await correlation_store(control).get(
            "gpu-overheat", "cooling_loop", "cooling_loop_a"
        )
        b, _ = await correlation_store(control).get(
            "gpu-overheat", "cooling_loop", "cooling_loop_b"
        )
        return a, b, await Overrides(control).all()

    loop_a, loop_b, overrides = asyncio.run(stored())
    assert loop_a.opened is not None and loop_a.applied
    assert set(loop_a.nodes) <= set(HOT_A) and len(loop_a.nodes) >= 3
    assert loop_b.opened is None, "one node of loop b is no domain episode"
    cap = overrides["cooling_loop_a"]
    assert cap.by == "engine" and cap.ends - cap.starts == 15 * 60
    policy = 8 * 4 * 700.0  # the loop's 8 nodes' 4 GPUs at the H200's 700 W policy
    assert cap.watts == pytest.approx(0.7 * policy)
    # The power controller holds the loop to it: limits come down on loop a's nodes only.
    budget = [d for d in decisions if d.match.rule == "power-budget" and d.accepted]
    assert budget and {d.match.node for d in budget} <= set(LOOP_A)
    told = [m for m in shadow.engine.recorder.notifier.sent if m["topic"] == "domain episode"]
    assert len(told) == 1 and "cooling_loop_a" in told[0]["text"]


def test_a_node_whose_fault_outlives_the_domain_s_hold_is_drained_on_its_own(
    tmp_path: Path,
) -> None:
    _, decisions = asyncio.run(_run(tmp_path, HOT_A, minutes=18))
    overheat = [d for d in decisions if d.match.rule == "gpu-overheat"]
    # The sim's cooling fault does not clear under a power cap: after the 15-minute hold
    # each node's fault is its own, and its drain goes through the node's stages.
    assert _drains(overheat), "still hot after the hold: drained"
    first_drain = min(d.match.at for d in overheat if d.accepted)
    opened = min(d.match.at for d in overheat if d.detail.startswith("opened: "))
    assert first_drain >= opened + 15 * 60


def test_domain_on_a_one_off_event_is_refused_with_file_line_and_rule(tmp_path: Path) -> None:
    (tmp_path / "bad.yml").write_text(
        "rules:\n"
        "  - name: xid-by-loop\n"
        "    on: xid\n"
        "    when: xid == 79\n"
        "    domain: {kind: cooling_loop, nodes: 3, within: 60s, hold: 15m}\n"
        "    actions: [{playbook: reboot.yml}]\n"
    )
    with pytest.raises(RuleError) as found:
        load_rules([tmp_path], ROOT / "playbooks")
    text = str(found.value)
    assert "bad.yml:5" in text and "xid-by-loop" in text and "telemetry" in text


def test_a_node_faulting_through_an_episode_does_not_keep_the_next_from_opening() -> None:
    """Review of issue 30: after a loop's episode ended, one node that went on faulting
    (its drain refused by a later stage, waiting for a person) kept the record's faults
    from ever clearing; a second loss of flow two hours later was then each node's own:
    three drains where one episode should hold them."""
    nodes = [f"n{i}" for i in range(1, 8)]
    inventory = Inventory(
        Path("inv"), frozenset(nodes), {}, {n: {"cooling_loop": "a"} for n in nodes}
    )
    opened: list[DomainEpisode] = []

    async def on_open(episode: DomainEpisode) -> None:
        opened.append(episode)

    stage = DomainCorrelation(MemoryKV("control"), Domains.of(inventory), on_open)
    rule = next(r for r in load_rules([ROOT / "rules"], ROOT / "playbooks").rules if r.domain)
    assert rule.domain is not None
    hold, within = rule.domain.hold_s, rule.domain.within_s

    async def fault(node: str, t: float) -> Drop | None:
        p = Proposal(
            match(rule.name, node, t, gpu=None), rule, t, [ActionSpec(playbook="drain.yml")], False
        )
        return await stage.check(p)

    async def scenario() -> list[Drop | None]:
        for node in nodes[:3]:  # the first loss of flow
            await fault(node, T0)
        t = T0
        while t < T0 + 8 * hold:  # n4 faults on through the episode and long after
            t += within / 4
            await fault("n4", t)
        return [await fault(node, t) for node in nodes[4:]]  # the second loss of flow

    second = asyncio.run(scenario())
    assert [d.reason if d else None for d in second] == [
        Reason.DOMAIN_WAIT,
        Reason.DOMAIN_WAIT,
        Reason.DOMAIN_HELD,
    ], "the loop's second episode opens, as its first did"
    assert [e.faulting for e in opened] == [("n1", "n2", "n3"), ("n5", "n6", "n7")]
