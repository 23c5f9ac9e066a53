"""The playbooks against a real Slurm: slurmctld and slurmd on loopback, real jobs.

The node is a simulated one (local connection; its nvidia-smi is the simulator's), and its
`scontrol` and `squeue` are Slurm's own, pointed at the test cluster through SLURM_CONF
(passed to runs as a site would: `executor.env_allow`).
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gpuops
import pytest
from gpuops.act.playbooks import resolve
from gpuops.act.runenv import RunEnv
from gpuops.act.runner import RunRequest, run_playbook
from gpuops.clock import SystemClock
from gpuops.models import RunOutcome, RunStatus
from gpuops.sim.fleet import SimFleet

from tests.conftest import ROOT
from tests.peers import slurm as peer

pytestmark = pytest.mark.integration

NODE = "node-001"
EPISODE = "gpu-xid-79@node-001:1764660000"
GPUOPS = {"rule": "gpu-xid-79", "episode": EPISODE, "reason": "XID 79 on GPU 0 (fell off the bus)"}
OURS = f"gpuops gpu-xid-79 {EPISODE}: XID 79 on GPU 0 (fell off the bus)"


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[peer.Slurm]:
    why = peer.missing()
    if why is not None:
        pytest.skip(why)
    with peer.slurm(tmp_path / "slurm", (NODE, "node-002")) as running:
        monkeypatch.setenv("SLURM_CONF", str(running.conf))
        yield running


def _fleet(tmp_path: Path, **over: Any) -> SimFleet:
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=2)
    fleet.write_inventory(
        fleet.root / "inventory",
        group_vars={
            "workload_manager": "slurm",
            "scontrol_bin": "/usr/bin/scontrol",
            "squeue_bin": "/usr/bin/squeue",
            "drain_poll_s": 1,
            "drain_timeout_s": 60,
            "reboot_poll_s": 1,
            "reboot_timeout_s": 60,
            **over,
        },
    )
    return fleet


def _run(fleet: SimFleet, playbook: str, **gpuops: object) -> RunOutcome:
    request = RunRequest(
        key=f"k-{playbook}",
        rule="gpu-xid-79",
        node=NODE,
        playbook=resolve(ROOT / "playbooks", playbook, None, fleet.root / "refs"),
        playbook_name=playbook,
        inventory=fleet.root / "inventory",
        timeout_s=180,
        limit=NODE,
        extravars={"gpuops": {"node": NODE, "intent_key": f"k-{playbook}", **gpuops}},
        env=RunEnv(allow=("SLURM_CONF",)),
    )
    return run_playbook(request, SystemClock())


def _running(cluster: peer.Slurm, seconds: float) -> str:
    job = cluster.submit(NODE, seconds)
    cluster.wait(f"job {job} running", lambda: cluster.job(job)["JobState"] == "RUNNING")
    return job


class States:
    """Every state and reason Slurm reports for the node while a run goes on, in order."""

    def __init__(self, cluster: peer.Slurm) -> None:
        self.cluster, self.seen = cluster, [("", "")]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> States:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            try:
                node = self.cluster.node(NODE)
            except RuntimeError:
                continue
            now = (node["State"], node.get("Reason", ""))
            if now != self.seen[-1]:
                self.seen.append(now)


def test_drain_takes_a_busy_node_out_with_gpuops_reason_and_lets_its_job_finish(
    cluster: peer.Slurm, tmp_path: Path
) -> None:
    job = _running(cluster, 15)  # longer than a run of drain.yml takes
    outcome = _run(_fleet(tmp_path), "drain.yml", **GPUOPS)
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    node = cluster.node(NODE)
    assert node["State"] in ("MIXED+DRAIN", "ALLOCATED+DRAIN"), "draining, its job still running"
    assert node["Reason"].startswith(OURS + " ["), node["Reason"]
    assert "node-002" not in cluster.run("sinfo", "-h", "-R", "-o", "%N"), "only its node"
    cluster.wait("the job's end", lambda: cluster.job(job)["JobState"] == "COMPLETED", 30)
    assert cluster.job(job)["ExitCode"] == "0:0", "it ran to its end, untouched"
    assert cluster.state(NODE) == "IDLE+DRAIN"


@pytest.mark.slow  # tens of seconds: a real job's run and a reboot
def test_reboot_through_slurm_waits_for_the_job_then_reboots_and_keeps_the_node_out(
    cluster: peer.Slurm, tmp_path: Path
) -> None:
    job = _running(cluster, 12)  # longer than ansible takes to reach the drain
    with States(cluster) as states:
        outcome = _run(_fleet(tmp_path, reboot_method="slurm"), "reboot.yml", **GPUOPS)
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    assert cluster.job(job)["JobState"] == "COMPLETED" and cluster.job(job)["ExitCode"] == "0:0"
    assert cluster.reboots() == [NODE], "Slurm's RebootProgram ran, for this node only"
    seen = [state for state, _ in states.seen[1:]]
    busy = [i for i, s in enumerate(seen) if "DRAIN" in s and s.startswith(("MIXED", "ALLOC"))]
    issued = [i for i, s in enumerate(seen) if "REBOOT_ISSUED" in s]
    assert busy and issued, seen
    drained_busy, issued = busy[0], issued[0]
    assert drained_busy < issued, f"the job ended before the reboot: {seen}"
    reasons = [reason for _, reason in states.seen[1:]]
    assert any(r.startswith(OURS + " [") for r in reasons), reasons
    # Back from its boot, it stays out of service with gpuops's reason until its probe.
    node = cluster.node(NODE)
    assert node["State"] == "DOWN", node
    assert node["Reason"].startswith(f"gpuops gpu-xid-79 {EPISODE}: reboot"), node["Reason"]
    assert "reboot complete" in node["Reason"]


def test_a_node_a_person_drained_is_left_alone_with_their_reason(
    cluster: peer.Slurm, tmp_path: Path
) -> None:
    cluster.run("scontrol", "update", f"nodename={NODE}", "state=drain", "reason=alice: fan swap")
    before = cluster.node(NODE)["Reason"]
    fleet = _fleet(tmp_path, reboot_method="slurm")
    for playbook in ("reboot.yml", "drain.yml", "return_to_service.yml"):
        outcome = _run(fleet, playbook, **GPUOPS)
        assert outcome.status is RunStatus.FAILED, playbook
        told = outcome.failed_message or ""  # what the executor's outcome and the audit say
        assert "is held by a person" in told and '"alice: fan swap"' in told, outcome.error
        assert outcome.held_by_person == "alice: fan swap", "told to the engine as data"
        assert cluster.node(NODE)["Reason"] == before, f"{playbook} kept the person's reason"
        assert cluster.state(NODE) == "IDLE+DRAIN", f"{playbook} left it drained"
    assert cluster.reboots() == [], "nothing rebooted"


def test_return_to_service_resumes_gpuops_drain_and_slurm_shows_the_node_idle(
    cluster: peer.Slurm, tmp_path: Path
) -> None:
    fleet = _fleet(tmp_path)
    assert _run(fleet, "drain.yml", **GPUOPS).status is RunStatus.SUCCESSFUL
    assert cluster.state(NODE) == "IDLE+DRAIN"
    outcome = _run(fleet, "return_to_service.yml", **GPUOPS)
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    node = cluster.node(NODE)
    assert (node["State"], node.get("Reason")) == ("IDLE", None), node
    job = _running(cluster, 1)  # and it takes work again
    cluster.wait("the job's end", lambda: cluster.job(job)["JobState"] == "COMPLETED", 20)


@pytest.mark.slow  # tens of seconds: Slurm's pings of a slurmd that does not answer
def test_return_to_service_waits_for_slurm_to_hear_from_the_node(
    cluster: peer.Slurm, tmp_path: Path
) -> None:
    """CI once read IDLE+NOT_RESPONDING just after a return from Slurm's reboot: resumed,
    but given no work. A return waits for Slurm to hear from the node, and one still
    silent after resume_timeout_s fails, naming the state; once it answers, it returns."""
    assert _run(_fleet(tmp_path / "a"), "drain.yml", **GPUOPS).status is RunStatus.SUCCESSFUL
    slurmd = int((cluster.root / "run" / f"slurmd-{NODE}.pid").read_text())
    os.kill(slurmd, signal.SIGSTOP)  # alive, but answers no ping
    try:
        cluster.wait("the node unheard", lambda: "NOT_RESPONDING" in cluster.state(NODE), 30)
        silent = _run(_fleet(tmp_path / "b", resume_timeout_s=2), "return_to_service.yml", **GPUOPS)
    finally:
        os.kill(slurmd, signal.SIGCONT)
    assert silent.status is RunStatus.FAILED
    assert "NOT_RESPONDING in Slurm after 2s of waiting" in (silent.failed_message or ""), silent
    back = _run(_fleet(tmp_path / "c"), "return_to_service.yml", **GPUOPS)
    assert back.status is RunStatus.SUCCESSFUL, back.error
    assert cluster.state(NODE) == "IDLE", "in service, and heard from"


@pytest.mark.slow  # tens of seconds: a real job's run and a reboot
def test_return_to_service_brings_a_node_back_from_slurm_s_reboot(
    cluster: peer.Slurm, tmp_path: Path
) -> None:
    fleet = _fleet(tmp_path, reboot_method="slurm")
    assert _run(fleet, "reboot.yml", **GPUOPS).status is RunStatus.SUCCESSFUL
    assert cluster.state(NODE) == "DOWN"
    outcome = _run(fleet, "return_to_service.yml", **GPUOPS)
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    assert cluster.state(NODE) == "IDLE"


@pytest.mark.slow  # tens of seconds: a real job's run and a reboot
def test_a_drain_whose_job_outlasts_the_timeout_fails_naming_it_and_kills_nothing(
    cluster: peer.Slurm, tmp_path: Path
) -> None:
    job = _running(cluster, 60)
    started = time.monotonic()
    outcome = _run(_fleet(tmp_path, drain_timeout_s=3), "reboot.yml", **GPUOPS)
    assert outcome.status is RunStatus.FAILED
    told = outcome.failed_message or ""
    assert f"Slurm jobs still running: {job} (wrap)" in told, outcome.error
    assert time.monotonic() - started < 60
    assert cluster.job(job)["JobState"] == "RUNNING", "the job was not killed"
    assert "DRAIN" in cluster.state(NODE), "the node stays drained"
    cluster.run("scancel", job)


def test_slurm_s_health_check_program_reports_an_unfit_node_and_leaves_the_drain_to_the_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    why = peer.missing()
    if why is not None:
        pytest.skip(why)
    fleet = _fleet(tmp_path)
    fleet.inject(NODE, "drift", 1, setting="persistence_mode", value=False)
    check = [
        sys.executable, "-m", "gpuops.cli", "agent", "--health-check", "--backend", "sim",
        "--sim-root", str(fleet.root), "--node", NODE,
    ]  # fmt: skip
    engine = Path(gpuops.__file__).resolve().parent.parent
    said = tmp_path / "health-check.log"
    program = (
        f"PYTHONPATH={shlex.quote(str(engine))} {shlex.join(check)} >> {shlex.quote(str(said))}"
    )
    with peer.slurm(tmp_path / "slurm", (NODE,), health_check=program) as cluster:
        monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
        finding = "ERROR: gpuops: GPU 1: persistence mode is off"
        cluster.wait(
            "slurmd's health check to run and find the node unfit",
            lambda: said.exists() and finding in said.read_text(),
        )
        # It said so, and drained nothing: a drain is the engine's decision (breaker, audit).
        assert cluster.state(NODE) == "IDLE", cluster.node(NODE)
        assert not cluster.node(NODE).get("Reason"), "no reason: nobody drained it"
        done = subprocess.run(
            check, env={**os.environ, "PYTHONPATH": str(engine)}, capture_output=True, text=True
        )
        assert done.returncode == 1, done.stderr
        assert finding in done.stdout
        assert f"gpuops: {NODE}: gpuops health: GPU 1: persistence mode is off" in done.stdout
