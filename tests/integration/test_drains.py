"""Drains that wait for running work, and per-GPU playbooks that take a list of GPUs.

Real ansible-runner runs of the shipped playbooks against simulated nodes whose
scontrol, squeue, kubectl and nvidia-smi shims model running Slurm jobs and Kubernetes
pods (gpuops/sim/work.py).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from gpuops.act.playbooks import resolve
from gpuops.act.runner import RunRequest, run_playbook
from gpuops.bus.conn import Bus
from gpuops.bus.server import EmbeddedNats
from gpuops.bus.store import NatsKV
from gpuops.clock import SystemClock
from gpuops.models import RunOutcome, RunStatus, subject_for
from gpuops.record.nodestate import NodeState, NodeStates
from gpuops.sim import state as node_state
from gpuops.sim.fleet import SimFleet, envelope

from tests.conftest import ROOT, calls, engine_settings, run_outcomes, running_engine, wait_for

pytestmark = pytest.mark.integration

NODE = "node-001"


def _fleet(tmp_path: Path, workload_manager: str = "slurm", **inventory: Any) -> SimFleet:
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=4, workload_manager=workload_manager)
    fleet.write_inventory(fleet.root / "inventory", {"drain_poll_s": 1, **inventory})
    return fleet


def _run(fleet: SimFleet, playbook: str, **gpuops: object) -> RunOutcome:
    request = RunRequest(
        key="t",
        rule="test",
        node=NODE,
        playbook=resolve(ROOT / "playbooks", playbook, None, fleet.root / "refs"),
        playbook_name=playbook,
        inventory=fleet.root / "inventory",
        timeout_s=120,
        limit=NODE,
        extravars={"gpuops": {"node": NODE, "rule": "test", **gpuops}},
    )
    return run_playbook(request, SystemClock())


def _timed_calls(fleet: SimFleet, tool: str) -> list[tuple[float, list[str]]]:
    path = fleet.node_dir(NODE) / "calls.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [(r["at"], r["argv"]) for r in rows if r["tool"] == tool]


def _poll(predicate: Any, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {limit_s}s: {predicate}"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_node_running_a_job_reboots_only_after_the_job_ended(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path, drain_timeout_s=300)
    fleet.inject(NODE, "job", id=4711, name="train-llm", duration="1h")

    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(_run, fleet, "reboot.yml", reason="XID 79", intent_key="k1")
        _poll(lambda: len(calls(fleet, NODE, "squeue")) >= 3)  # drained, and waiting
        assert calls(fleet, NODE, "reboot") == [], "no reboot while the job runs"
        with node_state.locked(fleet.node_dir(NODE)) as s:  # the job comes to its end
            job_ends = s["jobs"][0]["ends_at"] = time.time() + 1.0
        outcome = run.result(timeout=300)

    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    (rebooted_at, _), *more = _timed_calls(fleet, "reboot")
    assert more == [], "rebooted once"
    drained_at = next(t for t, argv in _timed_calls(fleet, "scontrol") if "state=drain" in argv)
    assert drained_at < job_ends <= rebooted_at, "drained while the job ran, rebooted after it"
    state = fleet.state(NODE)
    assert state["work_log"] == [
        {"kind": "job", "name": 4711, "how": "completed", "at": job_ends}
    ], "the job ended by itself; nothing was killed"
    assert state["boots"] == 1 and state["drained"] is True


@pytest.mark.slow
def test_pods_a_disruption_budget_protects_fail_the_drain_naming_them(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path, "kubernetes", drain_timeout_s=2)
    fleet.inject(NODE, "pod", name="web-0", namespace="shop", grace="1s", pdb=True)
    fleet.inject(NODE, "pod", name="batch-7", grace="0s")

    outcome = _run(fleet, "reboot.yml", reason="XID 79", intent_key="k2")

    assert outcome.status is RunStatus.FAILED
    error = outcome.error or ""
    assert "drain of node-001 failed after 2s" in error
    assert "pods still on it: shop/web-0;" in error
    assert "would violate the pod's disruption budget" in error
    assert calls(fleet, NODE, "reboot") == [], "nothing was rebooted"
    state = fleet.state(NODE)
    assert state["boots"] == 0 and state["cordoned"] is True
    assert [p["name"] for p in state["pods"]] == ["web-0"], "the protected pod still runs"
    assert [(w["name"], w["how"]) for w in state["work_log"]] == [("default/batch-7", "evicted")]


@pytest.mark.slow
def test_a_drain_that_outlasts_its_timeout_names_the_jobs_still_running(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path, drain_timeout_s=1)
    fleet.inject(NODE, "job", id=77, name="week-long", duration="7d")

    outcome = _run(fleet, "gpu_reset.yml", gpus=[0, 1], intent_key="k3")

    assert outcome.status is RunStatus.FAILED
    assert "drain of node-001 timed out after 1s" in (outcome.error or "")
    assert "Slurm jobs still running: 77 (week-long);" in (outcome.error or "")
    assert [g["resets"] for g in fleet.state(NODE)["gpus"]] == [0, 0, 0, 0]
    assert fleet.state(NODE)["drained"] is True, "the node stays drained"


def test_power_limit_sets_every_listed_gpu_in_one_run(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)
    for gpu in (0, 1, 2, 3):
        fleet.inject(NODE, "power_limit", gpu, watts=400)

    outcome = _run(fleet, "power_limit.yml", gpus=[0, 1, 2])

    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    assert [g["power_limit_w"] for g in fleet.state(NODE)["gpus"]] == [700.0, 700.0, 700.0, 400.0]
    sets = [argv for argv in calls(fleet, NODE, "nvidia-smi") if "-pl" in argv]
    assert sets == [["-i", str(gpu), "-pl", "700.0"] for gpu in (0, 1, 2)]


def test_power_limit_refuses_a_list_naming_a_gpu_the_node_lacks(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)
    fleet.inject(NODE, "power_limit", 0, watts=400)

    outcome = _run(fleet, "power_limit.yml", gpus=[0, 9])

    assert outcome.status is RunStatus.FAILED
    assert "node-001 has no GPU 9" in (outcome.error or "")
    assert fleet.state(NODE)["gpus"][0]["power_limit_w"] == 400.0, "no GPU was changed"


@pytest.mark.slow
def test_gpu_reset_resets_every_listed_gpu_after_the_drain(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)
    for gpu in (1, 3):
        fleet.inject(NODE, "zombie", gpu)

    outcome = _run(fleet, "gpu_reset.yml", gpus=[1, 3], intent_key="k4")

    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    state = fleet.state(NODE)
    assert [g["resets"] for g in state["gpus"]] == [0, 1, 0, 1]
    assert state["drained"] is True


@pytest.mark.slow  # a job's run, a drain and a repartition: `make test-slow`
def test_mig_configure_drains_waits_for_the_job_then_repartitions(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path)
    fleet.inject(NODE, "job", id=5, name="on-gpu-2", duration="2s", gpus=[2])

    outcome = _run(fleet, "mig_configure.yml", gpus=[0, 2], mig_profiles=[9, 9])

    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    state = fleet.state(NODE)
    assert state["drained"] is True, "the node stays out until its probe passes"
    assert [g["mig_instances"] if g["mig_mode"] else None for g in state["gpus"]] == [
        ["9", "9"],
        None,
        ["9", "9"],
        None,
    ]
    again = _run(fleet, "mig_configure.yml", gpus=[0, 2], mig_profiles=[9, 9])
    assert again.status is RunStatus.SUCCESSFUL and fleet.state(NODE)["gpus"] == state["gpus"]


def test_mig_configure_whose_drain_times_out_changes_no_gpu(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path, drain_timeout_s=2)
    fleet.inject(NODE, "job", id=5, name="on-gpu-2", duration="1h", gpus=[2])

    outcome = _run(fleet, "mig_configure.yml", gpus=[0, 2], mig_profiles=[9, 9])

    assert outcome.status is RunStatus.FAILED
    assert "5" in (outcome.error or "") and "on-gpu-2" in (outcome.error or ""), outcome.error
    assert [g["mig_mode"] for g in fleet.state(NODE)["gpus"]] == [False] * 4


@pytest.mark.slow
async def test_a_reboot_whose_drain_times_out_hands_the_node_to_a_person(
    tmp_path: Path, bus: Bus, nats_server: EmbeddedNats
) -> None:
    fleet = _fleet(tmp_path, "kubernetes", drain_timeout_s=2)
    fleet.inject(NODE, "pod", name="web-0", namespace="shop", pdb=True)
    settings = engine_settings(tmp_path, fleet, nats_server.url)
    states = NodeStates(NatsKV(bus.kv["nodes"]))

    async def handed_over() -> bool:
        return (await states.get(NODE)).state is NodeState.NEEDS_HUMAN

    async with running_engine(settings, bus) as app:
        xid = envelope("xid", NODE, time.time(), {"gpu": 1, "xid": 79})
        data = json.dumps(xid).encode()
        headers = app.keys.node(NODE).headers(data, {"Nats-Msg-Id": xid["id"]})
        await bus.js.publish(subject_for("xid", NODE), data, headers=headers)
        await wait_for(handed_over, 180)

    record = await states.get(NODE)
    assert record.why.startswith("reboot.yml failed: ")
    assert "drain of node-001 failed after 2s; pods still on it: shop/web-0;" in record.why
    assert [o.status for o in await run_outcomes(bus, NODE)] == [RunStatus.FAILED]
    assert calls(fleet, NODE, "reboot") == [], "the node was not rebooted under its pods"
    assert [p["name"] for p in fleet.state(NODE)["pods"]] == ["web-0"]
