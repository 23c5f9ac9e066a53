"""Graded diagnostics on a simulated node: diagnose.yml runs the tools (the simulator's
shims print each real tool's format), gpuops judges them, and the run's outcome carries
every check with its number."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from gpuops.act.playbooks import resolve
from gpuops.act.runenv import RunEnv
from gpuops.act.runner import RunRequest, run_playbook
from gpuops.clock import SystemClock
from gpuops.diagnose.fabric import pick_peers
from gpuops.inventory.domains import Domains
from gpuops.inventory.hosts import load_inventory
from gpuops.models import RunOutcome, RunStatus
from gpuops.sim.fleet import SimFleet

from tests.conftest import ROOT, calls

pytestmark = pytest.mark.integration

NODE = "node-001"


def _fleet(tmp_path: Path, gpus: int = 8, **over: object) -> SimFleet:
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=gpus)
    fleet.write_inventory(
        fleet.root / "inventory", group_vars={"diagnostics_dir": str(tmp_path / "diag"), **over}
    )
    return fleet


def _diagnose(fleet: SimFleet, grade: int, playbook: str = "diagnose.yml") -> RunOutcome:
    request = RunRequest(
        key=f"k-{playbook}",
        rule="test",
        node=NODE,
        playbook=resolve(ROOT / "playbooks", playbook, None, fleet.root / "refs"),
        playbook_name=playbook,
        inventory=fleet.root / "inventory",
        timeout_s=180,
        limit=NODE,
        extravars={"gpuops": {"node": NODE, "grade": grade}},
        # The filter plugin imports gpuops in ansible's Python: a checkout tested beside
        # an installed gpuops judges with its own code (CI has no PYTHONPATH: no change).
        env=RunEnv(allow=("PYTHONPATH",)),
    )
    return run_playbook(request, SystemClock())


def test_grade_1_on_a_healthy_node_passes_with_each_check_and_its_number(tmp_path: Path) -> None:
    outcome = _diagnose(_fleet(tmp_path, workload_manager="none"), 1)
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    assert outcome.grade is not None and outcome.grade.ok
    names = {c.name for c in outcome.grade.checks}
    assert {"gpus:count", "gpus:pcie width"} <= names
    assert any(n.startswith("dcgm:") for n in names)
    [count] = [c for c in outcome.grade.checks if c.name == "gpus:count"]
    assert count.value == 8.0
    kept = tmp_path / "diag" / NODE / "grade-1-dcgm-diag.json"
    assert '"DCGM Diagnostic"' in kept.read_text(), "the tool's own output is kept"


@pytest.mark.slow  # two grade runs: `make test-slow`
def test_a_node_is_held_to_its_own_sku_s_gpu_count(tmp_path: Path) -> None:
    """A 2-GPU simulated fleet declares its SKU (gpu_sku and a site skus file): its nodes
    pass with 2 GPUs, and the same node judged as an 8-GPU H200 fails on the count."""
    fleet = _fleet(tmp_path, gpus=2, workload_manager="none")
    outcome = _diagnose(fleet, 1)
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    assert outcome.grade is not None
    [count] = [c for c in outcome.grade.checks if c.name == "gpus:count"]
    assert (count.value, count.ok) == (2.0, True)
    fleet.write_inventory(
        fleet.root / "inventory", group_vars={"workload_manager": "none", "gpu_sku": "h200-8gpu"}
    )
    outcome = _diagnose(fleet, 1)
    assert outcome.status is RunStatus.FAILED
    assert "gpus count 2.0 (expect == 8)" in (outcome.error or "")


def test_grade_2_fails_on_one_gpu_s_slow_nvlink_naming_it_and_its_bandwidth(
    tmp_path: Path,
) -> None:
    fleet = _fleet(tmp_path, workload_manager="none")
    fleet.inject(NODE, "slow_d2d", 5, gbs=120.0)
    outcome = _diagnose(fleet, 2)
    assert outcome.status is RunStatus.FAILED
    assert outcome.grade is not None and not outcome.grade.ok
    [slow] = [c for c in outcome.grade.failing if c.name.startswith("nvbandwidth:device")]
    assert slow.value == 120.0 and slow.gpu == 5, slow
    summary = outcome.grade.summary()
    assert "120" in summary and "335" in summary, summary
    assert summary in (outcome.failed_message or ""), "the run fails with the grade's verdict"
    host = [c for c in outcome.grade.checks if c.name.startswith("nvbandwidth:host")]
    assert host and all(c.ok for c in host), "host<->device is fine"


def test_a_failing_dcgm_plugin_and_a_narrow_pcie_link_fail_grade_1(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path, workload_manager="none")
    fleet.inject(
        NODE, "dcgm_fail", 3, plugin="software", message="Persistence mode for GPU 3 is disabled"
    )
    fleet.inject(NODE, "pcie_narrow", 6, width=8)
    outcome = _diagnose(fleet, 1)
    assert outcome.status is RunStatus.FAILED and outcome.grade is not None
    failing = {(c.name, c.gpu) for c in outcome.grade.failing}
    assert ("gpus:pcie width", 6) in failing
    assert any(name.startswith("dcgm:") and gpu == 3 for name, gpu in failing), failing


@pytest.mark.slow  # every tool of the bundle, one by one: `make test-slow`
def test_grade_5_collects_the_service_bundle_on_a_node_in_service(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)  # Slurm, in service: a bundle loads nothing
    fleet.inject(NODE, "xid", 0, xid=79)  # the kernel log says so
    outcome = _diagnose(fleet, 5)
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    assert outcome.grade is not None and outcome.grade.grade == 5
    checks = {c.name: c for c in outcome.grade.checks}
    where = Path(checks["bundle:directory"].detail)
    assert where.parent == tmp_path / "diag" / NODE and where.name.startswith("service-")
    report = gzip.decompress((where / "nvidia-bug-report.log.gz").read_bytes()).decode()
    assert "Start of NVIDIA bug report log file." in report and "GPU 00000007" in report
    assert "Linux version" in (where / "dmesg.txt").read_text()
    assert "NVIDIA-SMI" in (where / "nvidia-smi-q.txt").read_text()
    assert json.loads((where / "dcgm-diag.json").read_text())
    assert (where / "bmc-sel.txt").stat().st_size > 0, "the BMC's event log (ipmitool)"
    collected = [n for n, c in checks.items() if n != "bundle:directory" and c.ok]
    assert len(collected) == 5, outcome.grade.summary()
    assert outcome.grade.summary() == f"grade 5: service bundle at {where} (5 of 5 parts)"
    assert calls(fleet, NODE, "all_reduce_perf") == [] and calls(fleet, NODE, "nvbandwidth") == []
    assert calls(fleet, NODE, "nvidia-bug-report"), "the report ran on the node"


@pytest.mark.slow  # every tool of the bundle, one by one: `make test-slow`
def test_a_bundle_brings_no_more_of_a_nodes_output_than_its_bounds(tmp_path: Path) -> None:
    # What the node writes is its own: a report past bundle_max_bytes stays out of the
    # controller's disk, and a text part past bundle_max_text_bytes is cut, saying so.
    remote = tmp_path / "on-node"
    remote.mkdir()
    fleet = _fleet(
        tmp_path, bundle_max_bytes=64, bundle_max_text_bytes=40, bundle_remote_dir=str(remote)
    )
    outcome = _diagnose(fleet, 5)
    assert outcome.grade is not None
    checks = {c.name: c for c in outcome.grade.checks}
    where = Path(checks["bundle:directory"].detail)
    report = checks["bundle:nvidia-bug-report"]
    assert not report.ok and "more than bundle_max_bytes (64)" in report.detail, report
    assert not (where / "nvidia-bug-report.log.gz").exists()
    dmesg = (where / "dmesg.txt").read_text()
    assert dmesg.startswith("[    0.000000] Linux version") and len(dmesg) < 200, dmesg
    assert "cut at bundle_max_text_bytes" in dmesg
    assert checks["bundle:dmesg"].ok, "a part cut to its bound is still collected"
    assert calls(fleet, NODE, "nvidia-bug-report"), "the report was written on the node"
    assert not list(remote.iterdir()), "and not left there"


@pytest.mark.slow  # a real Slurm and a grade run: `make test-slow`
def test_grade_2_refuses_a_slurm_node_in_service(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)  # Slurm (the simulator's scontrol), in service
    outcome = _diagnose(fleet, 2)
    assert outcome.status is RunStatus.FAILED
    assert "runs on a node out of service only" in (outcome.failed_message or outcome.error or "")
    assert outcome.grade is None, "nothing was measured"
    fleet.inject(NODE, "drained")  # gpuops drained it (as a remediation does)
    assert _diagnose(fleet, 2).status is RunStatus.SUCCESSFUL


def test_the_gate_back_into_service_keeps_a_node_out_that_fails_its_grade(tmp_path: Path) -> None:
    # return_to_service.yml with the validation's grade: the grade runs first and a failed
    # check fails the return, naming the check and its number; a sound twin's return passes.
    fleet = _fleet(tmp_path, workload_manager="none")
    fleet.inject(NODE, "slow_d2d", 2, gbs=120.0)
    outcome = _diagnose(fleet, 2, "return_to_service.yml")
    assert outcome.status is RunStatus.FAILED
    assert outcome.grade is not None and not outcome.grade.ok
    assert "120" in (outcome.failed_message or ""), outcome.failed_message
    outcome = _diagnose(
        _fleet(tmp_path / "fixed", workload_manager="none"), 2, "return_to_service.yml"
    )
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    assert outcome.grade is not None and outcome.grade.ok
    assert any(c.name.startswith("nvbandwidth:device") for c in outcome.grade.checks)


def test_the_gate_refuses_a_loading_grade_on_a_node_still_in_service(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path, workload_manager="kubernetes")
    outcome = _diagnose(fleet, 2, "return_to_service.yml")
    assert outcome.status is RunStatus.FAILED
    assert "runs on a node out of service only" in (outcome.failed_message or "")
    assert outcome.grade is None, "no tool ran"


def _fabric(tmp_path: Path, bad: str) -> tuple[RunOutcome, list[str]]:
    """Grade 4 on node-001 of a 3-rack fleet, one HCA of `bad` at 90 Gb/s; the peers as
    the engine picks them (another rack, in service)."""
    fleet = SimFleet.create(tmp_path / "sim", nodes=9, gpus=2)
    fleet.write_inventory(
        fleet.root / "inventory",
        group_vars={"workload_manager": "none", "ib_hcas": ["mlx5_0", "mlx5_3"]},
    )
    inventory = load_inventory(fleet.root / "inventory")
    peers = pick_peers(NODE, sorted(inventory.hosts), Domains.of(inventory).by_node, out=set())
    assert len(peers) == 2 and all(inventory.hostvars[p]["rack"] != "rack-a1" for p in peers)
    fleet.inject(peers[0] if bad == "peer" else NODE, "bad_hca", device="mlx5_3", gbps=90.0)
    request = RunRequest(
        key="k-fabric",
        rule="test",
        node=NODE,
        playbook=resolve(ROOT / "playbooks", "diagnose.yml", None, fleet.root / "refs"),
        playbook_name="diagnose.yml",
        inventory=fleet.root / "inventory",
        timeout_s=180,
        limit=NODE,
        extravars={"gpuops": {"node": NODE, "grade": 4, "peers": peers}},
        env=RunEnv(allow=("PYTHONPATH",)),
    )
    return run_playbook(request, SystemClock()), peers


def test_fabric_a_bad_hca_fails_the_first_pair_and_the_second_pass_blames_the_node(
    tmp_path: Path,
) -> None:
    outcome, (first, second) = _fabric(tmp_path, bad="node")
    assert outcome.status is RunStatus.FAILED and outcome.grade is not None
    [verdict] = [c for c in outcome.grade.checks if c.name == "fabric:verdict"]
    assert not verdict.ok
    assert f"{NODE} fails again, {first} passes: {NODE} is at fault" in verdict.detail
    assert f"[blamed: {NODE}]" in verdict.detail
    slow = [c for c in outcome.grade.failing if c.name == "ib_write_bw:mlx5_3"]
    assert len(slow) == 1 and slow[0].value == 90.0 and f"{NODE}~{second}" in slow[0].detail
    assert "ib_write_bw mlx5_3" in (outcome.error or ""), "the failing check names the HCA"


@pytest.mark.slow  # two fabric passes, the peer at fault (the node's case stays): `make test-slow`
def test_fabric_a_bad_hca_on_the_peer_clears_the_node_and_names_the_peer(
    tmp_path: Path,
) -> None:
    outcome, (first, _) = _fabric(tmp_path, bad="peer")
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    assert outcome.grade is not None and outcome.grade.ok
    [verdict] = [c for c in outcome.grade.checks if c.name == "fabric:verdict"]
    assert f"{first} is at fault, not {NODE}" in verdict.detail
    assert f"[blamed: {first}]" in verdict.detail
