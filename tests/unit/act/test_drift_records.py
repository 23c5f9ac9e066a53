"""The drift check reads differences from a typed key in task results, never from task names."""

from __future__ import annotations

from pathlib import Path

from gpuops.act.driftcheck import (
    DRIFT_KEY,
    MAX_READINGS,
    TOPOLOGY_KEY,
    DriftReport,
    HostDrift,
    compare_topology,
    drift_records,
    topology_readings,
)
from gpuops.diagnose.topology import GpuPlace, Manifest, Manifests, NicPlace
from gpuops.inventory.hosts import Inventory


def test_a_result_carrying_the_key_gives_typed_records() -> None:
    res = {
        "changed": True,
        "msg": {
            DRIFT_KEY: [
                {"setting": "power_limit", "gpu": "1", "expected": 700.0, "actual": 400.0},
                {"setting": "driver_version", "gpu": None, "expected": "1.2", "actual": "1.1"},
            ]
        },
    }
    assert drift_records(res) == [
        {"setting": "power_limit", "gpu": 1, "expected": 700.0, "actual": 400.0},
        {"setting": "driver_version", "gpu": None, "expected": "1.2", "actual": "1.1"},
    ]


def test_a_task_name_or_an_untyped_message_is_not_drift() -> None:
    # What the old name-based contract looked like: a changed debug with a dict message.
    named = {"changed": True, "msg": {"setting": "ecc_mode", "expected": "Enabled"}}
    assert drift_records(named) == []
    assert drift_records({"msg": "Drift ecc_mode"}) == []
    assert drift_records({"msg": {DRIFT_KEY: "not a list"}}) == []
    assert drift_records(None) == []


def test_topology_readings_are_bounded_and_compared_for_gpus_only() -> None:
    """A manifest learnt on real hardware lists HCAs too; the drift check reads GPUs only,
    so it judges GPUs only (the agent judges HCAs), and a runaway output is cut."""
    res = {"msg": {TOPOLOGY_KEY: {"links": ["0, 00000000:18:00.0, 1, 8, 0"] * 500, "numa": 7}}}
    readings = topology_readings(res)
    assert readings is not None and len(readings["links"]) == MAX_READINGS
    assert readings["numa"] == [], "not a list: nothing read"
    assert topology_readings({"msg": {DRIFT_KEY: []}}) is None

    manifest = Manifest(
        sku="h200-8gpu",
        gpus={0: GpuPlace(pci="0000:18:00.0", pcie_gen=5, pcie_width=16, numa=0)},
        nics={"mlx5_0": NicPlace(numa=0, rate_gbps=400.0)},
    )
    report = DriftReport(group="all", started=0.0)
    report.hosts["n1"] = HostDrift(
        "n1", readings={"links": ["0, 00000000:18:00.0, 1, 8, 0"], "numa": []}
    )
    report.hosts["n2"] = HostDrift("n2")  # reported no readings (topology_check: false)
    inventory = Inventory(
        Path("inv"),
        frozenset({"n1", "n2"}),
        {},
        {"n1": {"gpu_sku": "h200-8gpu"}, "n2": {"gpu_sku": "h200-8gpu"}},
    )
    compare_topology(report, inventory, Manifests({"h200-8gpu": manifest}))
    assert [(d["check"], d["gpu"]) for d in report.hosts["n1"].topology] == [("pcie_width", 0)]
    assert report.hosts["n2"].topology == []
