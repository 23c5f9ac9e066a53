"""Check mode for every catalogued playbook: it predicts a run's changes and makes none.

Each case puts one simulated node where the playbook has work to do and, where that
makes sense, a second node where it has none; one `--check` run through the engine's
ansible-runner bridge covers both (one run per case keeps the suite fast), and a third
node outside the limit shows the run stayed within it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from gpuops.act.playbooks import resolve
from gpuops.act.runner import RunRequest, run_playbook
from gpuops.catalog import load_catalog
from gpuops.clock import SystemClock
from gpuops.fence.dra import find_device, taint_rule
from gpuops.models import RunStatus
from gpuops.sim import state as node_state
from gpuops.sim.dra_shims import resource_slice
from gpuops.sim.fleet import SimFleet

from tests.conftest import ROOT, calls

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PLAYBOOKS = ROOT / "playbooks"
CHANGING, SETTLED, OUTSIDE = "node-001", "node-002", "node-003"
Setup = Callable[[SimFleet, str], None]


@dataclass(frozen=True)
class Case:
    """Node states where the playbook has work to do (`change`) and none (`settled`)."""

    change: Setup
    settled: Setup | None
    gpuops: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def _gpu1(**values: Any) -> Setup:
    def setup(fleet: SimFleet, node: str) -> None:
        with node_state.locked(fleet.node_dir(node)) as s:
            s["gpus"][1].update(values)

    return setup


def _healthy(fleet: SimFleet, node: str) -> None:
    """A node in service with nothing wrong: nothing to set up."""


def _drained(fleet: SimFleet, node: str) -> None:
    """Drained by gpuops earlier (its reason): what gpuops may resume or drain again."""
    fleet.inject(node, "drained", reason="gpuops gpu-xid-79 gpu-xid-79@node-002:1700000000: XID 79")


def _both(first: Setup, second: Setup) -> Setup:
    def setup(fleet: SimFleet, node: str) -> None:
        first(fleet, node)
        second(fleet, node)

    return setup


def _done(intent_key: str, then: Setup = _healthy) -> Setup:
    """The intent already ran here: its marker is on the node (what once_mark.yml writes)."""

    def setup(fleet: SimFleet, node: str) -> None:
        marker = fleet.node_dir(node) / "done" / intent_key
        marker.parent.mkdir(parents=True)
        marker.write_text("test\n")
        then(fleet, node)

    return setup


K8S = {"workload_manager": "kubernetes"}


# Every catalogued playbook has a case; drain and return to service one per workload
# manager. Diagnostics are collected anew every time: that case has no settled node.
def _fenced(fleet: SimFleet, node: str) -> None:
    """GPU 1 fenced NoSchedule already, as fence_gpu.yml leaves it (the simulated API)."""
    slices = {"items": [resource_slice(fleet.state(node))]}
    uuid = fleet.state(node)["gpus"][1]["uuid"]
    rule = taint_rule(find_device(slices, node, uuid), "NoSchedule", "check")
    with node_state.locked(fleet.root / "k8s") as cluster:
        cluster["taint_rules"][rule["metadata"]["name"]] = rule


CASES: dict[str, Case] = {
    "power_limit.yml": Case(_gpu1(power_limit_w=400.0), _healthy, {"gpu": 1}),
    "gpu_reset.yml": Case(_healthy, _done("k-reset"), {"gpu": 1, "intent_key": "k-reset"}),
    "reboot.yml": Case(_healthy, _done("k-reboot", _drained), {"intent_key": "k-reboot"}),
    "reprovision.yml": Case(_healthy, _done("k-rep", _drained), {"intent_key": "k-rep"}),
    "drain.yml": Case(_healthy, _drained, {"reason": "check"}),
    "drain.yml kubernetes": Case(_healthy, _drained, {"reason": "check"}, K8S),
    "return_to_service.yml": Case(_drained, _healthy),
    "return_to_service.yml kubernetes": Case(_drained, _healthy, {}, K8S),
    "baseline.yml": Case(_gpu1(persistence_mode=False, power_limit_w=500.0), _healthy),
    "mig_configure.yml": Case(
        _healthy,
        _both(_drained, _gpu1(mig_mode=True, mig_instances=["9", "9"])),
        {"gpu": 1, "mig_profiles": [9, 9]},
    ),
    "fence_gpu.yml": Case(_healthy, _fenced, {"gpu": 1, "effect": "NoSchedule"}, K8S),
    "collect_diagnostics.yml": Case(_healthy, None),
    "diagnose.yml": Case(_healthy, None, {"grade": 1}),
}


def test_every_catalogued_playbook_has_a_check_case() -> None:
    catalogued = set(load_catalog(PLAYBOOKS).specs)
    assert {name.split(" ")[0] for name in CASES} == catalogued


@pytest.mark.parametrize("name", sorted(CASES))
def test_check_mode_predicts_the_change_and_makes_none(name: str, tmp_path: Path) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=3, gpus=2)
    case = CASES[name]
    case.change(fleet, CHANGING)
    hosts = [CHANGING]
    if case.settled is not None:
        case.settled(fleet, SETTLED)
        hosts.append(SETTLED)
    before = {n: fleet.state(n) for n in fleet.nodes}, fleet.taint_rules()
    playbook = name.split(" ")[0]
    request = RunRequest(
        key="check",
        rule="test",
        node=CHANGING,
        playbook=resolve(PLAYBOOKS, playbook, None, tmp_path / "refs"),
        playbook_name=playbook,
        inventory=fleet.root / "inventory",
        timeout_s=600,  # generous: a loaded CI machine, not the playbook, sets the pace
        limit=",".join(hosts),
        check_mode=True,
        extravars={
            "gpuops": {"node": CHANGING, "rule": "test", **case.gpuops},
            "diagnostics_dir": str(tmp_path / "diagnostics"),
            **case.extra,
        },
    )

    outcome = run_playbook(request, SystemClock())

    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    changed = {h: outcome.stats[h].get("changed", 0) for h in hosts}
    assert changed[CHANGING] >= 1, f"no change predicted: {outcome.stats}"
    if case.settled is not None:
        assert changed[SETTLED] == 0, f"a change predicted where none is due: {outcome.changed}"
    after = {n: fleet.state(n) for n in fleet.nodes}, fleet.taint_rules()
    assert after == before, "check mode changed a node or the cluster"
    assert not (fleet.node_dir(CHANGING) / "done").exists(), "check mode wrote an intent marker"
    assert not (tmp_path / "diagnostics").exists(), "check mode wrote diagnostics"
    assert calls(fleet, OUTSIDE) == [], "the run went beyond its --limit"
