"""A rule that asks for a grade of diagnostics (`diagnose: N`) instead of a fix, and the
fabric grade's peers, picked by the engine in the live stages."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpuops import subjects
from gpuops.bus.publish import MemoryPublisher
from gpuops.clock import ManualClock
from gpuops.errors import RuleSetError
from gpuops.match.loader import load_rules
from gpuops.models import Intent

from tests.support import decide
from tests.unit.decide.helpers import INVENTORY, ROOT, T0, engine_on, match

RULES = """
rules:
  - name: ib-slow
    on: ib
    when: ports_down > 0
    actions:
      - diagnose: 4
  - name: ib-slow-named
    on: ib
    when: ports_down > 1
    actions:
      - diagnose: 4
        vars: {peers: [node-019, node-020]}
  - name: nvlink-check
    on: xid
    when: xid == 74
    actions:
      - diagnose: 2
        vars: {reason: "NVLink error {{ xid }}"}
"""


def _rules(tmp_path: Path, text: str = RULES) -> Path:
    path = tmp_path / "rules" / "diag.yml"
    path.parent.mkdir()
    path.write_text(text)
    return path.parent


def test_diagnose_n_is_the_catalogue_s_diagnose_playbook_at_that_grade(tmp_path: Path) -> None:
    rules = {r.name: r for r in load_rules([_rules(tmp_path)], ROOT / "playbooks").rules}
    [fabric] = rules["ib-slow"].actions
    assert (fabric.playbook, fabric.vars, fabric.timeout_s) == ("diagnose.yml", {"grade": 4}, 1800)
    [medium] = rules["nvlink-check"].actions
    assert medium.vars == {"reason": "NVLink error {{ xid }}", "grade": 2}


@pytest.mark.parametrize(
    ("action", "problem"),
    [
        ("diagnose: 6", "diagnose"),
        ("diagnose: 2\n        vars: {grde: 1}", "does not accept variable 'grde'"),
    ],
)
def test_a_bad_diagnose_action_names_file_line_and_rule(
    tmp_path: Path, action: str, problem: str
) -> None:
    text = f"rules:\n  - name: bad-one\n    on: xid\n    actions:\n      - {action}\n"
    with pytest.raises(RuleSetError) as err:
        load_rules([_rules(tmp_path, text)], ROOT / "playbooks")
    said = str(err.value)
    assert "diag.yml:" in said and "bad-one" in said and problem in said, said


async def test_the_fabric_grade_gets_two_known_good_peers_outside_the_node_s_rack(
    tmp_path: Path,
) -> None:
    rules = load_rules([_rules(tmp_path)], ROOT / "playbooks")
    engine = engine_on(ManualClock(T0), rules=rules)
    busy = engine.states.store.model(node="node-015", state="quarantined", quarantined=True)
    await engine.states.store.put(busy, "node-015")
    d = await decide(engine.pipeline, match("ib-slow", gpu=None, kind="ib", ports_down=1))
    assert d.accepted, d
    peers = d.actions[0].vars["peers"]
    assert len(peers) == 2 and "node-015" not in peers, peers
    assert all(
        INVENTORY.hostvars[p]["rack"] != INVENTORY.hostvars["node-001"]["rack"] for p in peers
    )
    assert f"fabric peers: {', '.join(peers)}" in d.detail
    again = await decide(
        engine_on(ManualClock(T0), rules=rules).pipeline,
        match("ib-slow", gpu=None, kind="ib", ports_down=1),
    )
    assert again.actions[0].vars["peers"] == peers, "the same peers for the same node"

    named = await decide(
        engine_on(ManualClock(T0), rules=rules).pipeline,
        match("ib-slow-named", gpu=None, kind="ib", ports_down=2),
    )
    assert named.actions[0].vars["peers"] == ["node-019", "node-020"], "a rule's own peers"


async def test_the_fabric_check_holds_its_peers_so_nothing_remediates_one_mid_test(
    tmp_path: Path,
) -> None:
    rules = load_rules([_rules(tmp_path), ROOT / "rules"], ROOT / "playbooks")
    dbe = {r.name: r for r in rules.rules}["xid-48-dbe"]
    ib = match("ib-slow", gpu=None, kind="ib", ports_down=1)
    first_choice = (await decide(engine_on(ManualClock(T0), rules=rules).pipeline, ib)).actions
    usual = first_choice[0].vars["peers"][0]
    clock, publisher = ManualClock(T0), MemoryPublisher()
    engine = engine_on(clock, rules=rules, publisher=publisher)
    assert (await decide(engine.pipeline, match("xid-48-dbe", usual))).accepted
    d = await decide(engine.pipeline, ib)  # the usual peer's reset runs: not a peer now
    peers = d.actions[0].vars["peers"]
    assert d.accepted and usual not in peers and len(peers) == 2, (usual, peers)
    assert d.peers_locked == tuple(peers)
    for peer in peers:
        held, _ = await engine.locks.holder(peer)
        assert held is not None and (held.peer_of, held.event_id) == ("node-001", d.match.event_id)
    reset = await engine.pipeline.decider.decide(match(dbe.name, peers[0], clock.now()), dbe)
    assert reset.reason.value == "locked", "a peer under test is remediated after the test"

    [intent] = [
        i
        for s, body in publisher.messages
        if subjects.is_action(s) and (i := Intent.model_validate_json(body)).node == "node-001"
    ]
    assert intent.locked == ("node-001", *peers)
    for node in intent.locked:  # what the run's end gives back (act.completion)
        assert await engine.locks.release(node, intent.event_id)
    again = await engine.pipeline.decider.decide(match(dbe.name, peers[0], clock.now(), gpu=2), dbe)
    assert again.accepted, "the peer is free once the check ended"


async def test_a_rule_s_own_peer_already_locked_drops_the_check_and_takes_nothing(
    tmp_path: Path,
) -> None:
    rules = load_rules([_rules(tmp_path), ROOT / "rules"], ROOT / "playbooks")
    engine = engine_on(ManualClock(T0), rules=rules)
    assert (await decide(engine.pipeline, match("xid-48-dbe", "node-020"))).accepted
    d = await decide(engine.pipeline, match("ib-slow-named", gpu=None, kind="ib", ports_down=2))
    assert d.reason.value == "locked" and "fabric peer node-020 of node-001" in d.detail, d
    for node in ("node-001", "node-019"):
        held, _ = await engine.locks.holder(node)
        assert held is None, f"{node}'s lock was given back when the peer's was refused"


LADDER = """
ladders:
  - name: deeper-first
    window: 1d
    rungs:
      - playbook: reboot.yml
      - diagnose: 3
      - playbook: reprovision.yml
      - diagnose: 5
rules:
  - name: gpu-gone
    on: xid
    when: xid == 79
    group_by: node
    ladder: deeper-first
"""


async def test_a_ladder_runs_a_deeper_grade_before_reprovisioning_and_the_bundle_last(
    tmp_path: Path,
) -> None:
    rules = load_rules([_rules(tmp_path, LADDER)], ROOT / "playbooks")
    [ladder] = [r.ladder for r in rules.rules if r.ladder]
    assert [(r.playbook, r.vars.get("grade"), r.timeout_s) for r in ladder.rungs] == [
        ("reboot.yml", None, 600.0),
        ("diagnose.yml", 3, 5400.0),
        ("reprovision.yml", None, 600.0),
        ("diagnose.yml", 5, 1800.0),
    ]
    clock = ManualClock(T0)
    engine = engine_on(clock, rules=rules)
    seen, out = [], []
    for _ in range(4):
        out.append((await engine.states.get("node-001")).quarantined)
        d = await decide(engine.pipeline, match("gpu-gone", gpu=None, t=clock.now()))
        seen.append([(a.playbook, a.vars.get("grade")) for a in d.actions])
        await engine.locks.release("node-001", d.match.event_id)
        clock.advance(3600)
    assert seen == [
        [("reboot.yml", None)],
        [("diagnose.yml", 3)],  # the node is out after its reboot: the grade runs there
        [("reprovision.yml", None)],
        [("diagnose.yml", 5)],
    ], seen
    assert out == [False, True, True, True], "out of service from the reboot on"


async def test_a_rule_s_peers_written_as_text_are_the_inventory_s_hosts(tmp_path: Path) -> None:
    text = RULES.replace("peers: [node-019, node-020]", 'peers: "node-019, node-020, nosuch"')
    rules = load_rules([_rules(tmp_path, text)], ROOT / "playbooks")
    engine = engine_on(ManualClock(T0), rules=rules)
    d = await decide(engine.pipeline, match("ib-slow-named", gpu=None, kind="ib", ports_down=2))
    assert d.accepted and d.actions[0].vars["peers"] == ["node-019", "node-020"], d
    assert d.peers_locked == ("node-019", "node-020")
    assert "fabric peers left out (not in the inventory, or the node): ['nosuch']" in d.detail
