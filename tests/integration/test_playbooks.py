"""Playbooks through ansible-runner: refusals, pinned git refs, no fleet-wide runs, secrets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import ansible_runner
import pytest
from gpuops.act.playbooks import resolve
from gpuops.act.runner import RunRequest, run_playbook
from gpuops.clock import SystemClock
from gpuops.models import RunOutcome, RunStatus
from gpuops.sim.fleet import SimFleet

from tests.conftest import ROOT, calls

pytestmark = pytest.mark.integration


def _run(
    fleet: SimFleet,
    playbook: str,
    playbooks: Path = ROOT / "playbooks",
    ref: str | None = None,
    **gpuops: object,
) -> tuple[RunStatus, str, RunOutcome]:
    version = resolve(playbooks, playbook, ref, fleet.root / "refs")
    request = RunRequest(
        key="t",
        rule="test",
        node="node-001",
        playbook=version,
        playbook_name=playbook,
        inventory=fleet.root / "inventory",
        timeout_s=120,
        limit="node-001",
        extravars={"gpuops": {"node": "node-001", **gpuops}},
    )
    outcome = run_playbook(request, SystemClock())
    return outcome.status, outcome.error or "", outcome


def test_mig_on_a_busy_gpu_is_refused_with_what_to_do(tmp_path: Path) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=2)
    fleet.inject("node-001", "busy", 0, pid=31337)
    status, error, _ = _run(fleet, "mig_configure.yml", gpu=0, mig_profiles=[9, 9])
    assert status is RunStatus.FAILED
    assert "still runs processes 31337" in error and "after the drain" in error
    assert fleet.state("node-001")["drained"] is True, "drained first; it stays out for a person"
    assert fleet.state("node-001")["gpus"][0]["mig_mode"] is False, "nothing was changed"


def test_power_limit_outside_the_device_range_is_refused(tmp_path: Path) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=1)
    status, error, _ = _run(fleet, "power_limit.yml", gpu=0, watts="900")
    assert status is RunStatus.FAILED and "outside GPU 0's range 200.0-700.0 W" in error


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
    )
    return done.stdout.strip()


def test_a_pinned_ref_runs_the_playbook_as_it_was(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "playbooks").mkdir(parents=True)
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@example.com")
    _git(repo, "config", "user.name", "t")
    book = repo / "playbooks" / "mark.yml"
    template = (
        "- name: Mark\n  hosts: all\n  gather_facts: false\n  tasks:\n"
        "    - name: Write the version\n"
        '      ansible.builtin.copy:\n        dest: "{{{{ sim_node_dir }}}}/version"\n'
        "        content: {v}\n        mode: '0644'\n"
    )
    book.write_text(template.format(v="one"))
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "v1")
    _git(repo, "tag", "v1.0.0")
    first = _git(repo, "rev-parse", "HEAD")
    book.write_text(template.format(v="two"))
    _git(repo, "commit", "-qam", "v2")
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=1)

    status, _, outcome = _run(fleet, "mark.yml", repo / "playbooks", ref="v1.0.0")
    assert status is RunStatus.SUCCESSFUL
    assert (fleet.node_dir("node-001") / "version").read_text() == "one"
    assert outcome.revision == first
    status, _, outcome = _run(fleet, "mark.yml", repo / "playbooks")
    assert (fleet.node_dir("node-001") / "version").read_text() == "two"
    assert outcome.revision == _git(repo, "rev-parse", "HEAD")


def _by_hand(fleet: SimFleet, tmp_path: Path, playbook: str, *args: str) -> Any:
    """ansible-playbook as a person runs it: the fleet's inventory and no --limit."""
    (tmp_path / "runner").mkdir(exist_ok=True)
    return ansible_runner.run(
        private_data_dir=str(tmp_path / "runner"),
        playbook=str(ROOT / "playbooks" / playbook),
        inventory=str(fleet.root / "inventory"),
        cmdline=" ".join(args),
        quiet=True,
        envvars={"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"},
    )


def test_a_playbook_without_a_limit_refuses_the_whole_fleet(tmp_path: Path) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=2, gpus=1)
    refused = _by_hand(fleet, tmp_path, "drain.yml")
    assert refused.status == "failed"
    assert "this run has no --limit" in refused.stdout.read()
    assert all(calls(fleet, node) == [] for node in fleet.nodes), "nothing ran anywhere"

    allowed = _by_hand(fleet, tmp_path, "drain.yml", "-e", "gpuops_allow_fleet=true")
    assert allowed.status == "successful"
    assert all(fleet.state(node)["drained"] for node in fleet.nodes)


def test_the_engine_always_limits_a_run_to_its_node(tmp_path: Path) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=2, gpus=1)
    request = RunRequest(
        key="t",
        rule="test",
        node="node-002",
        playbook=resolve(ROOT / "playbooks", "drain.yml", None, tmp_path),
        playbook_name="drain.yml",
        inventory=fleet.root / "inventory",
        timeout_s=600,
        limit=None,  # the bridge falls back to the request's node
    )
    assert run_playbook(request, SystemClock()).status is RunStatus.SUCCESSFUL
    assert [fleet.state(n)["drained"] for n in fleet.nodes] == [False, True]


@pytest.mark.slow  # a reboot through ipmi_sim: `make test-slow`
def test_the_bmc_password_reaches_ipmitool_on_its_standard_input(tmp_path: Path) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=1)
    password = "Zq81-bmc-secret"
    request = RunRequest(
        key="t",
        rule="test",
        node="node-001",
        playbook=resolve(ROOT / "playbooks", "reprovision.yml", None, tmp_path),
        playbook_name="reprovision.yml",
        inventory=fleet.root / "inventory",
        timeout_s=600,
        limit="node-001",
        extravars={"gpuops": {"intent_key": "k-reprovision"}, "bmc_password": password},
    )
    outcome = run_playbook(request, SystemClock())
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    assert fleet.state("node-001")["boots"] == 1, "the power cycle went through"
    ipmi = calls(fleet, "node-001", "ipmitool")
    # One-time PXE, then a cold cycle the BMC confirms at each step.
    assert [argv[argv.index("/dev/stdin") + 1 :] for argv in ipmi] == [
        ["chassis", "bootdev", "pxe"],
        ["chassis", "power", "status"],
        ["chassis", "power", "off"],
        ["chassis", "power", "status"],
        ["chassis", "power", "on"],
        ["chassis", "power", "status"],
    ]
    # The password on ipmitool's standard input, read as its password file.
    assert all(argv[argv.index("-f") + 1] == "/dev/stdin" and "-P" not in argv for argv in ipmi)
    assert not any(password in arg for argv in calls(fleet, "node-001") for arg in argv)


def test_the_ipmitool_shim_wants_the_password_it_was_told_to_read(tmp_path: Path) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=1)
    tool = str(fleet.node_dir("node-001") / "bin" / "ipmitool")
    env = {k: v for k, v in os.environ.items() if k != "IPMI_PASSWORD"}
    argv = [
        tool,
        "-I",
        "lanplus",
        "-H",
        "127.0.0.1",
        "-U",
        "sim",
        "-E",
        "chassis",
        "power",
        "status",
    ]
    missing = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    assert missing.returncode == 1
    assert "Unable to read password from environment" in missing.stderr
    given = subprocess.run(
        argv, capture_output=True, text=True, env={**env, "IPMI_PASSWORD": "x"}, check=False
    )
    assert (given.returncode, given.stdout.strip()) == (0, "Chassis Power is on")
