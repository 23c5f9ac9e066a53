"""The agent's quick checks as a node health check: what one reading says is wrong."""

from __future__ import annotations

from typing import Any

from gpuops.agent.healthcheck import Finding, findings, reason


def _gpu(index: int, **over: Any) -> dict[str, Any]:
    fit = {
        "index": index,
        "remap_failure": False,
        "remap_pending": False,
        "ecc_dbe_volatile": 0,
        "ecc_mode": True,
        "persistence_mode": True,
        "pcie_gen": 1,  # idle: the generation drops by design, and is never judged
        "pcie_max_gen": 5,
        "pcie_width": 16,
        "pcie_max_width": 16,
    }
    return {**fit, **over}


def test_a_fit_node_has_no_findings_even_with_its_pcie_generation_idle_low() -> None:
    assert findings([_gpu(0), _gpu(1)], [], expect_gpus=2) == []


def test_each_unfit_reading_is_one_finding_naming_its_gpu() -> None:
    gpus = [
        _gpu(0, remap_failure=True),
        _gpu(1, remap_pending=True),
        _gpu(2, ecc_dbe_volatile=3),
        _gpu(3, ecc_mode=False),
        _gpu(4, persistence_mode=False),
        _gpu(5, pcie_width=8),
    ]
    assert findings(gpus, [], expect_gpus=None) == [
        Finding(0, "row remapping failed: the GPU needs replacing"),
        Finding(1, "a row remap is pending: the GPU needs a reset"),
        Finding(2, "3 uncorrectable ECC errors since the driver loaded"),
        Finding(3, "ECC is off: memory errors go unseen"),
        Finding(4, "persistence mode is off"),
        Finding(5, "PCIe link is x8 of x16"),
    ]


def test_missing_and_lost_gpus_come_first_and_unknown_readings_are_not_judged() -> None:
    unread = {"index": 1}  # a reading without the fields (NVML "Not Supported")
    found = findings([_gpu(0), unread], lost=[3], expect_gpus=8)
    assert found == [
        Finding(None, "2 GPUs answer, 8 expected"),
        Finding(3, "fell off the bus (NVML lost it)"),
    ]
    assert found[0].line() == "ERROR: gpuops: 2 GPUs answer, 8 expected"
    assert found[1].line() == "ERROR: gpuops: GPU 3: fell off the bus (NVML lost it)"


def test_the_slurm_reason_is_gpuops_with_the_first_finding_and_a_count() -> None:
    found = [Finding(4, "persistence mode is off"), Finding(5, "PCIe link is x8 of x16")]
    assert reason(found) == "gpuops health: GPU 4: persistence mode is off (+1 more)"
    assert reason(found[:1]) == "gpuops health: GPU 4: persistence mode is off"
