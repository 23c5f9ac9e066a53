"""power_limit.yml with per-GPU watts (the power controller's form), on a simulated node."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpuops.models import RunStatus
from gpuops.sim.fleet import SimFleet

from tests.conftest import calls
from tests.integration.test_playbooks import _run

pytestmark = pytest.mark.integration


def test_per_gpu_limits_set_each_gpu_to_its_own_watts(tmp_path: Path) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=4)
    status, error, _ = _run(fleet, "power_limit.yml", gpus=[0, 2, 3], limits="0:450,2:520.5,3:700")
    assert status is RunStatus.SUCCESSFUL, error
    limits = [g["power_limit_w"] for g in fleet.state("node-001")["gpus"]]
    assert limits == [450.0, 700.0, 520.5, 700.0]
    assert ["-i", "3", "-pl", "700.0"] not in calls(fleet, "node-001", "nvidia-smi"), "unchanged"


@pytest.mark.slow
def test_per_gpu_limits_as_a_mapping_and_a_gpu_without_one_is_refused(tmp_path: Path) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=2)
    status, error, _ = _run(fleet, "power_limit.yml", gpus=[0, 1], limits={"0": 300})
    assert status is RunStatus.FAILED and "no watts for GPU(s) 1" in error
    assert fleet.state("node-001")["gpus"][0]["power_limit_w"] == 700.0, "nothing was set"
    status, error, _ = _run(fleet, "power_limit.yml", gpus=[0, 1], limits={"0": 300, "1": 900})
    assert status is RunStatus.FAILED and "900.0 W is outside GPU 1's range" in error
    status, error, _ = _run(fleet, "power_limit.yml", gpus=[1], limits={1: 640})
    assert status is RunStatus.SUCCESSFUL, error
    assert fleet.state("node-001")["gpus"][1]["power_limit_w"] == 640.0
