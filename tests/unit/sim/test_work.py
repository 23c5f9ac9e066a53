"""Running work on a simulated node, as its scontrol, squeue, kubectl and nvidia-smi show it."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from gpuops.errors import ConfigError
from gpuops.sim import state as node_state
from gpuops.sim import work
from gpuops.sim.fleet import SimFleet
from gpuops.sim.scenario import load_scenario

NODE = "node-001"


@pytest.fixture
def fleet(tmp_path: Path) -> SimFleet:
    return SimFleet.create(tmp_path / "sim", nodes=1, gpus=2)


def _tool(fleet: SimFleet, tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    binary = fleet.node_dir(NODE) / "bin" / tool
    return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=60)


def _ends_in(fleet: SimFleet, seconds: float) -> float:
    with node_state.locked(fleet.node_dir(NODE)) as s:
        s["jobs"][0]["ends_at"] = ends = time.time() + seconds
    return ends


def test_slurm_shows_a_draining_node_as_allocated_until_its_job_ends(fleet: SimFleet) -> None:
    fleet.inject(NODE, "job", id=42, name="train", duration="1h", gpus=[0])
    assert (
        _tool(fleet, "scontrol", "update", f"nodename={NODE}", "state=drain", "reason=x").returncode
        == 0
    )

    assert "State=MIXED+DRAIN" in _tool(fleet, "scontrol", "show", "node", NODE).stdout
    assert _tool(fleet, "squeue", "-w", NODE, "-h", "-o", "%i (%j)").stdout == "42 (train)\n"
    assert _tool(fleet, "nvidia-smi", "-i", "0", "--query-compute-apps=pid").stdout == "100042\n"

    _ends_in(fleet, -1.0)
    assert "State=IDLE+DRAIN" in _tool(fleet, "scontrol", "show", "node", NODE).stdout
    assert _tool(fleet, "squeue", "-w", NODE, "-h").stdout == ""
    assert _tool(fleet, "nvidia-smi", "-i", "0", "--query-compute-apps=pid").stdout == ""


def test_a_gpu_held_by_a_job_refuses_a_reset_as_nvidia_smi_does(fleet: SimFleet) -> None:
    fleet.inject(NODE, "job", duration="1h")
    done = _tool(fleet, "nvidia-smi", "-r", "-i", "1")
    assert done.returncode == 255 and "currently in use by another process" in done.stderr
    assert fleet.state(NODE)["gpus"][1]["resets"] == 0


def test_a_reboot_kills_the_work_still_running_and_logs_it(fleet: SimFleet) -> None:
    fleet.inject(NODE, "job", id=7, duration="1h")
    fleet.inject(NODE, "job", id=8, duration="1h")
    ended = _ends_in(fleet, -5.0)
    _tool(fleet, "reboot")
    log = fleet.state(NODE)["work_log"]
    assert [(w["name"], w["how"]) for w in log] == [(7, "completed"), (8, "killed")]
    assert log[0]["at"] == ended, "a job that finished is logged at its own end"


def test_kubectl_drain_evicts_waits_for_the_grace_period_and_respects_a_pdb(
    fleet: SimFleet,
) -> None:
    fleet.inject(NODE, "pod", name="web-0", namespace="shop", grace="0s", pdb=True)
    fleet.inject(NODE, "pod", name="batch-1", grace="1s")

    done = _tool(fleet, "kubectl", "drain", NODE, "--ignore-daemonsets", "--timeout=2s")

    assert done.returncode == 1
    assert f"node/{NODE} cordoned" in done.stdout and "evicting pod default/batch-1" in done.stdout
    assert (
        'error when evicting pods/"web-0" -n "shop" (will retry after 5s): '
        "Cannot evict pod as it would violate the pod's disruption budget." in done.stderr
    )
    assert 'pods/"web-0" -n "shop": global timeout reached: 2s' in done.stderr
    pods = json.loads(
        _tool(
            fleet,
            "kubectl",
            "get",
            "pods",
            "-A",
            "--field-selector",
            f"spec.nodeName={NODE}",
            "-o",
            "json",
        ).stdout
    )["items"]
    assert [(p["metadata"]["namespace"], p["metadata"]["name"]) for p in pods] == [
        ("shop", "web-0")
    ]
    evicted = fleet.state(NODE)["work_log"][0]
    assert (evicted["name"], evicted["how"]) == ("default/batch-1", "evicted")
    assert fleet.state(NODE)["cordoned"] and not fleet.state(NODE)["drained"]


def test_kubectl_drain_succeeds_once_the_pods_are_gone(fleet: SimFleet) -> None:
    fleet.inject(NODE, "pod", name="batch-1", grace="1s")
    done = _tool(fleet, "kubectl", "drain", NODE, "--ignore-daemonsets", "--timeout=60s")
    assert done.returncode == 0 and done.stdout.endswith(f"node/{NODE} drained\n")
    assert _tool(fleet, "kubectl", "get", "pods", "-o", "json").stdout.count('"name"') == 0
    again = _tool(fleet, "kubectl", "drain", NODE, "--ignore-daemonsets", "--timeout=60s")
    assert f"node/{NODE} already cordoned" in again.stdout


def test_work_runs_on_the_wall_clock_whatever_time_the_fault_carries(fleet: SimFleet) -> None:
    fleet.inject(NODE, "job", at=0.0, duration="30s")
    job = fleet.state(NODE)["jobs"][0]
    assert abs(job["started_at"] - time.time()) < 5
    assert job["ends_at"] - job["started_at"] == 30.0


def test_a_pod_is_gone_at_its_own_end_or_its_grace_after_eviction() -> None:
    state = node_state.new_node(NODE, 2)
    pod = work.add_pod(state, 100.0, name="p", grace_s=10, duration_s=50)
    assert work.pod_gone_at(pod) == 150.0
    pod["evicted_at"] = 120.0
    assert work.pod_gone_at(pod) == 130.0
    assert work.running_pods(state, 129.0) == [pod] and work.running_pods(state, 130.0) == []


def test_scenario_entries_put_jobs_and_pods_on_nodes(tmp_path: Path) -> None:
    path = tmp_path / "work.yml"
    path.write_text(
        "name: work\nfaults:\n"
        "  - {at: 5s, fault: job, node: 1, name: train, duration: 10m}\n"
        "  - {at: 5s, fault: pod, node: 2, name: web-0, pdb: true, grace: 30s}\n"
        "  - {at: 6s, fault: overheat, node: 2, gpu: 1}\n"
    )
    faults = load_scenario(str(path), ["node-001", "node-002"]).faults
    assert [(f.fault, f.node, f.params) for f in faults[:2]] == [
        ("job", "node-001", {"name": "train", "duration": "10m"}),
        ("pod", "node-002", {"name": "web-0", "pdb": True, "grace": "30s"}),
    ]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            "{fault: job, duraton: 10m}",
            "job: unknown key(s) duraton; known: duration, gpus, id, name",
        ),
        ("{fault: pod, grace: soon}", "pod: grace: bad duration 'soon'"),
    ],
)
def test_a_bad_work_entry_is_refused_with_what_is_wrong(
    tmp_path: Path, entry: str, message: str
) -> None:
    path = tmp_path / "bad.yml"
    path.write_text(f"name: bad\nfaults:\n  - {entry}\n")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_scenario(str(path), ["node-001"])


def test_a_recovery_action_fault_shows_in_the_gpu_s_telemetry(tmp_path: Path) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=2)
    fleet.inject("node-001", "recovery_action", 1, action=4)
    sample = fleet.telemetry("node-001", 1.0)
    assert sample is not None
    assert [g["recovery_action"] for g in sample["data"]["gpus"]] == [0, 4]
