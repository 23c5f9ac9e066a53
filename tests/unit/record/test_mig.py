"""MIG layouts: the -lgi table read back, what fits one H200, and what an under-used GPU gets."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from gpuops.record import mig
from gpuops.sim import state as node_state
from gpuops.sim.fleet import SimFleet

GB = 1e9


def test_the_simulated_table_reads_back_as_the_layout_created(tmp_path: Path) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=1)
    with node_state.locked(fleet.node_dir("node-001")) as s:
        s["gpus"][0]["mig_mode"] = True
    smi = str(fleet.node_dir("node-001") / "bin" / "nvidia-smi")
    made = subprocess.run(
        [smi, "mig", "-i", "0", "-cgi", "14,19,9", "-C"],
        text=True,
        capture_output=True,
        check=False,
    )
    listed = subprocess.run(
        [smi, "mig", "-i", "0", "-lgi"], text=True, capture_output=True, check=False
    )

    assert made.returncode == 0, made.stderr
    assert mig.parse_lgi(listed.stdout) == [14, 19, 9]


def test_a_layout_larger_than_the_gpu_is_refused_as_the_driver_does(tmp_path: Path) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=1)
    with node_state.locked(fleet.node_dir("node-001")) as s:
        s["gpus"][0]["mig_mode"] = True
    smi = str(fleet.node_dir("node-001") / "bin" / "nvidia-smi")
    made = subprocess.run(
        [smi, "mig", "-i", "0", "-cgi", "9,9,19", "-C"], text=True, capture_output=True, check=False
    )

    assert made.returncode == 6 and "Insufficient Resources" in made.stderr
    assert not mig.fits([9, 9, 19]) and mig.fits([9, 9]) and mig.fits([19] * 7)
    assert not mig.fits([19] * 8), "seven compute slices"


def test_no_instances_is_an_empty_layout() -> None:
    assert mig.parse_lgi("No GPU instances found: Not Found\n") == []


@pytest.mark.parametrize(
    ("p95", "mem_gb", "want"),
    [
        (5.0, 8.0, [19] * 7),  # a notebook: seven 1g.18gb
        (5.0, 25.0, [15] * 4),  # small compute, more memory: four 1g.35gb
        (20.0, 25.0, [14] * 3),  # two compute slices: three 2g.35gb
        (30.0, 50.0, [9] * 2),  # three slices, 50 GB: two 3g.71gb
    ],
)
def test_the_smallest_profile_that_carries_the_workload_is_packed(
    p95: float, mem_gb: float, want: list[int]
) -> None:
    got = mig.recommend(p95, mem_gb * GB)

    assert got.kind == "mig" and list(got.profiles) == want, got
    assert mig.fits(list(got.profiles))


def test_a_workload_needing_most_of_the_gpu_keeps_it_whole() -> None:
    assert mig.recommend(60.0, 20 * GB).kind == "none"
    assert mig.recommend(5.0, 100 * GB).kind == "none"


def test_a_development_pool_is_time_sliced() -> None:
    got = mig.recommend(8.0, 10 * GB, development=True)

    assert got.kind == "time-slicing" and got.replicas == 8
    assert mig.recommend(30.0, 10 * GB, development=True).replicas == 2
