"""Facility telemetry over Redfish against real Redfish services: sushy-tools' static
emulator serving the shipped mockups (a cooling unit with a leak detector, an H200
server's BMC) over HTTPS. The source reads them over urllib3; the events go through
the live engine's code (the shadow engine) and the shipped facility rules decide."""

from __future__ import annotations

import asyncio
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
from gpuops.bus.publish import MemoryPublisher
from gpuops.clock import ManualClock
from gpuops.errors import SourceError
from gpuops.inventory.hosts import Inventory
from gpuops.match.loader import load_rules
from gpuops.models import EVENT_ADAPTER, Decision, Reason
from gpuops.settings import RedfishSourceSettings, RedfishTarget, Settings
from gpuops.sources.redfish import RedfishSource
from gpuops.spine.shadow import Shadow
from pydantic import ValidationError

from tests.conftest import ROOT
from tests.peers.facility import Facility, facility
from tests.peers.redfish import missing
from tests.support import gpuops_argv

pytestmark = pytest.mark.skipif(missing() is not None, reason=str(missing()))
T0 = 1_900_000_000.0
CONNECTOR = "ThermalEquipment/CDUs/1/PrimaryCoolantConnectors/1"
DETECTOR = "ThermalEquipment/CDUs/1/LeakDetection/LeakDetectors/1"
HOSTVARS = {
    "cdu-a": {"cooling_loop": "loop-a"},
    "node-001": {"rack": "r1", "cooling_loop": "loop-a", "pdu": "pdu-r1"},
}
INVENTORY = Inventory(
    Path("inv"), frozenset(HOSTVARS), {"facility": frozenset({"cdu-a"})}, HOSTVARS
)


def _source(cdu: Facility, server: Facility, clock: ManualClock) -> RedfishSource:
    cfg = RedfishSourceSettings(
        targets=(
            RedfishTarget(node="cdu-a", url=cdu.url, ca=cdu.ca),
            RedfishTarget(node="node-001", url=server.url, ca=server.ca),
        )
    )
    return RedfishSource(cfg, INVENTORY, MemoryPublisher(), clock)


def _by_sensor(events: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f"{e['node']}:{e['data']['sensor']}": e["data"] for e in events}


def test_a_cdu_and_a_server_read_over_https_with_their_loop_and_rack(tmp_path: Path) -> None:
    with facility(tmp_path / "cdu", "cdu") as cdu, facility(tmp_path / "srv", "server") as srv:
        events = asyncio.run(_source(cdu, srv, ManualClock(T0)).poll_once())
    got = _by_sensor(events)
    supply = got["cdu-a:cdu-1/primary-1/supply_temp_c"]
    assert supply["value"] == 32.0 and supply["cooling_loop"] == "loop-a"
    assert got["cdu-a:cdu-1/primary-1/flow_lpm"]["value"] == 1850.0
    assert got["cdu-a:cdu-1/pump-1"]["value"] == 62.0
    assert got["cdu-a:cdu-1/leak-1"]["state"] == "OK"
    assert got["node-001:1/inlet-temp"] == {
        "sensor": "1/inlet-temp",
        "metric": "inlet_temp_c",
        "value": 24.0,
        "resource": "/redfish/v1/Chassis/1/Thermal#/Temperatures/0",
        "rack": "r1",
        "pdu": "pdu-r1",
        "cooling_loop": "loop-a",
    }
    assert sum(1 for d in got.values() if d["metric"] == "psu_input_w") == 6
    assert sum(1 for d in got.values() if d["metric"] == "fan_rpm") == 4
    assert "1/exhaust-temp" not in {k.split(":")[1] for k in got}, "intake only"
    for event in events:
        EVENT_ADAPTER.validate_python(event)


def test_a_leak_going_to_warning_and_a_rising_supply_are_decided_by_the_facility_rules(
    tmp_path: Path,
) -> None:
    settings = Settings.model_validate(
        {"rules_dir": ROOT / "rules", "playbooks_dir": ROOT / "playbooks"}
    )
    shadow = Shadow(
        load_rules([ROOT / "rules"], ROOT / "playbooks"),
        INVENTORY.hosts,
        settings,
        None,
        HOSTVARS,
        INVENTORY.groups,
    )
    clock = ManualClock(T0)
    decisions: list[Decision] = []
    # The facility water warms over six minutes; the drip tray turns wet at minute 4.
    supply = [32.0, 32.5, 33.5, 35.0, 36.0, 37.5, 38.0]
    with facility(tmp_path / "cdu", "cdu") as cdu, facility(tmp_path / "srv", "server") as srv:
        source = _source(cdu, srv, clock)
        for minute, temp in enumerate(supply):
            cdu.set(CONNECTOR, {"SupplyTemperatureCelsius": {"Reading": temp}})
            if minute == 4:
                cdu.set(DETECTOR, {"DetectorState": "Warning"})
            for event in asyncio.run(source.poll_once()):
                decisions += asyncio.run(shadow.feed(EVENT_ADAPTER.validate_python(event)))
            clock.advance(60)
    fired = [
        (d.match.rule, d.match.node, d.match.at - T0)
        for d in decisions
        if d.reason is not Reason.COOLDOWN  # the rule holds true; told once
    ]
    leaks = [f for f in fired if f[0] == "coolant-leak"]
    assert leaks == [("coolant-leak", "cdu-a", 240.0)], "the leak at minute 4, once"
    rising = [f for f in fired if f[0] == "coolant-supply-rising"]
    assert rising and rising[0][1] == "cdu-a" and rising[0][2] == 300.0, "32 -> 37.5 C"
    first = next(d for d in decisions if d.match.rule == "coolant-leak")
    assert first.reason is Reason.NO_ACTION and first.notify, "told at once; nothing to run"
    assert first.match.facts["cooling_loop"] == "loop-a", "the loop is named"
    assert not any(d.match.rule == "inlet-hot" for d in decisions), "the server's air is cool"


def test_an_https_target_without_its_ca_or_unknown_to_the_inventory_is_refused() -> None:
    with pytest.raises(ValidationError, match="https needs `ca`"):
        RedfishTarget(node="cdu-a", url="https://10.0.0.9")
    cfg = RedfishSourceSettings(targets=(RedfishTarget(node="cdu-z", url="http://127.0.0.1:1"),))
    with pytest.raises(SourceError, match="cdu-z is not in the inventory"):
        RedfishSource(cfg, INVENTORY, MemoryPublisher(), ManualClock(T0))


def test_a_target_that_does_not_answer_costs_its_poll_and_not_the_other(tmp_path: Path) -> None:
    with facility(tmp_path / "cdu", "cdu") as cdu:
        cfg = RedfishSourceSettings(
            targets=(
                RedfishTarget(node="cdu-a", url=cdu.url, ca=cdu.ca),
                RedfishTarget(node="node-001", url="http://127.0.0.1:9", ca=None),
            ),
            timeout_s=2.0,
        )
        source = RedfishSource(cfg, INVENTORY, MemoryPublisher(), ManualClock(T0))
        events = asyncio.run(source.poll_once())
    assert {e["node"] for e in events} == {"cdu-a"}
    assert "http://127.0.0.1:9" in source.failed


def test_gpuops_ingest_redfish_once_prints_the_events(tmp_path: Path) -> None:
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        "all:\n  children:\n    facility:\n      hosts:\n        cdu-a: {cooling_loop: loop-a}\n"
    )
    with facility(tmp_path / "cdu", "cdu") as cdu:
        cdu.set(DETECTOR, {"DetectorState": "Critical"})
        done = subprocess.run(
            [
                *gpuops_argv(state_dir=tmp_path / "state"),
                *("ingest", "redfish", "--once", "--inventory", str(inventory)),
                *("--target", f"cdu-a={cdu.url}", "--ca", str(cdu.ca)),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert done.returncode == 0, done.stderr
    events = [json.loads(line) for line in done.stdout.splitlines()]
    leak = next(e for e in events if e["data"]["metric"] == "leak")
    assert leak["node"] == "cdu-a" and leak["data"]["state"] == "Critical"
    assert leak["data"]["cooling_loop"] == "loop-a" and leak["kind"] == "facility"
