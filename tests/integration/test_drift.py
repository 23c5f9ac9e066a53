"""Drift on the simulated fleet: found exactly, safe settings fixed, the rest wait for a person."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpuops.act.driftcheck import drift_check, render_report
from gpuops.bus.conn import Bus
from gpuops.bus.server import EmbeddedNats
from gpuops.clock import SystemClock
from gpuops.diagnose.topology import Manifests
from gpuops.inventory.hosts import load_inventory
from gpuops.match.loader import load_rules
from gpuops.match.matcher import Matcher
from gpuops.models import EVENT_ADAPTER
from gpuops.record.approvals import ApprovalStatus
from gpuops.record.audit import read_audit
from gpuops.sim import state as node_state
from gpuops.sim.fleet import SimFleet

from tests.conftest import ROOT, counted, engine_settings, run_outcomes, running_engine, wait_for

pytestmark = pytest.mark.integration


async def test_drift_found_fixed_where_safe_approval_for_the_rest(
    tmp_path: Path, bus: Bus, nats_server: EmbeddedNats
) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=5, gpus=2)
    fleet.inject("node-002", "drift", 1, setting="persistence_mode", value=False)
    fleet.inject("node-003", "power_limit", 0, watts=500)
    fleet.inject("node-004", "drift", 0, setting="ecc_mode", value=False)
    # A host that cannot be reached: SSH to a closed port.
    (fleet.root / "inventory" / "ghost.yml").write_text(
        "all:\n  hosts:\n    node-ghost:\n      ansible_connection: ssh\n"
        "      ansible_host: 127.0.0.1\n      ansible_port: 1\n"
        "      ansible_python_interpreter: /usr/bin/python3\n"
    )
    settings = engine_settings(tmp_path, fleet, nats_server.url)
    async with running_engine(settings, bus) as app:
        reply = await app.run_drift_check("all")
        assert "6 hosts, 3 drifted, 1 unreachable" in reply
        assert "node-ghost: unreachable" in reply
        assert "node-002: persistence_mode[gpu 1] Disabled!=Enabled" in reply
        await wait_for(lambda: counted(app.engine.metrics.runs) >= 2, 60)
        await wait_for(lambda: any(m["topic"] == "approval needed" for m in app.notifier.sent), 10)
        approvals = await app.engine.approvals.all()

        again = await app.run_drift_check("all")
    assert "6 hosts, 1 drifted" in again and "node-004: ecc_mode" in again, again
    assert fleet.state("node-002")["gpus"][1]["persistence_mode"] is True
    assert fleet.state("node-003")["gpus"][0]["power_limit_w"] == 700.0
    assert fleet.state("node-004")["gpus"][0]["ecc_mode"] is False, "not changed without approval"
    assert [(a.node, a.status) for a in approvals] == [("node-004", ApprovalStatus.PENDING)]
    fixes = {o.node: o for o in await run_outcomes(bus)}
    assert set(fixes) == {"node-002", "node-003"}
    assert all(o.playbook == "baseline.yml" and o.status == "successful" for o in fixes.values())
    summaries = [r.body["drift_check"] async for r in read_audit(bus.js) if "drift_check" in r.body]
    assert [s["drifted"] for s in summaries] == [["node-002", "node-003", "node-004"], ["node-004"]]
    assert all(s["hosts_checked"] == 6 for s in summaries), "every host has a 'last checked'"
    assert all(s["unreachable"] == ["node-ghost"] for s in summaries)
    ghost = [r async for r in read_audit(bus.js, "node-ghost")]
    assert any(r.rule == "host-unreachable" for r in ghost), "its own event, matched by its rule"


async def test_the_baseline_reports_each_gpu_whose_mig_layout_is_not_the_inventory_s(
    tmp_path: Path,
) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=3)
    with node_state.locked(fleet.node_dir("node-001")) as s:
        for g in s["gpus"]:
            g["mig_mode"] = True
        s["gpus"][0]["mig_instances"] = ["9", "9"]  # the baseline's layout
        s["gpus"][1]["mig_instances"] = ["19", "19", "19"]
        s["gpus"][2]["mig_instances"] = []  # MIG on, no instance: "No GPU instances found"
    (fleet.root / "inventory" / "mig.yml").write_text(
        "all:\n  hosts:\n    node-001:\n      baseline_mig_mode: true\n      mig_profiles: [9, 9]\n"
    )

    report = await drift_check(
        load_inventory(fleet.root / "inventory"), ROOT / "playbooks", SystemClock()
    )

    drifts = sorted(report.hosts["node-001"].drifts, key=lambda d: d["gpu"])
    assert drifts == [
        {"setting": "mig_layout", "gpu": 1, "expected": [9, 9], "actual": [19, 19, 19]},
        {"setting": "mig_layout", "gpu": 2, "expected": [9, 9], "actual": []},
    ]
    assert fleet.state("node-001")["gpus"][1]["mig_instances"] == ["19", "19", "19"], "only read"


async def test_the_drift_check_holds_each_node_to_its_topology_manifest(tmp_path: Path) -> None:
    """The nightly check finds what the agent would, from the node itself (nvidia-smi and
    sysfs through baseline.yml): a link trained narrow, a GPU on the wrong NUMA node, a
    slow link under load; an idle GPU at Gen1 is no fault, and a twin that matches its
    SKU's manifest is clean. Each difference is a `topology` event the shipped rules act on.
    """
    fleet = SimFleet.create(tmp_path / "sim", nodes=3, gpus=8)
    fleet.inject("node-002", "pcie_narrow", 3, width=8)
    fleet.inject("node-002", "numa", 5, to=0)
    fleet.inject("node-003", "pcie_slow", 1, gen=3)  # idle: its Gen1 proves nothing
    fleet.inject("node-003", "pcie_slow", 2, gen=3)
    fleet.inject("node-003", "load", 2, all_gpus=False)  # loaded: Gen3 where Gen5 is due
    report = await drift_check(
        load_inventory(fleet.root / "inventory"),
        ROOT / "playbooks",
        SystemClock(),
        manifests=Manifests.load(ROOT / "topology"),
    )
    found = {
        h: sorted((d["check"], d["gpu"], d["expected"], d["actual"]) for d in r.topology)
        for h, r in report.hosts.items()
    }
    assert found == {
        "node-001": [],
        "node-002": [("numa", 5, 1, 0), ("pcie_width", 3, 16, 8)],
        "node-003": [("pcie_gen", 2, 5, 3)],
    }, found
    assert report.drifted == ["node-002", "node-003"] and report.state_of("node-001") == "clean"
    assert report.summary()["topology"] == {
        "node-002": ["numa", "pcie_width"],
        "node-003": ["pcie_gen"],
    }
    said = render_report(report)
    assert "node-002: topology pcie_width[gpu 3] 8!=16, topology numa[gpu 5] 0!=1" in said, said

    matcher = Matcher(load_rules([ROOT / "rules"], ROOT / "playbooks"))
    fired = sorted(
        (m.rule, m.node, m.facts["gpu"])
        for e in report.events()
        if e["kind"] == "topology"
        for m in matcher.match(EVENT_ADAPTER.validate_python(e))
    )
    assert fired == [
        ("topology-misplaced", "node-002", 5),
        ("topology-pcie-degraded", "node-002", 3),
        ("topology-pcie-degraded", "node-003", 2),
    ]
    assert {e["source"] for e in report.events()} == {"drift-check"}


async def test_a_node_without_a_manifest_for_its_sku_is_not_compared(tmp_path: Path) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=2)  # SKU h200-8gpu-sim2
    fleet.inject("node-001", "pcie_narrow", 1, width=4)
    report = await drift_check(
        load_inventory(fleet.root / "inventory"),
        ROOT / "playbooks",
        SystemClock(),
        manifests=Manifests.load(ROOT / "topology"),
    )
    assert report.hosts["node-001"].readings is not None, "read all the same"
    assert report.hosts["node-001"].topology == [] and report.drifted == []
