"""Drift on the simulated fleet: found exactly, safe settings fixed, the rest wait for a person."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuops.bus.conn import Bus
from gpuops.bus.server import EmbeddedNats
from gpuops.decide.approval import ApprovalStatus
from gpuops.record.audit import read_audit
from gpuops.sim.fleet import SimFleet
from tests.conftest import counted, engine_settings, run_outcomes, running_engine, wait_for

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
