"""Playbooks through the engine's ansible-runner bridge: refusals, and pinned git refs."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from engine.act.playbooks import resolve
from engine.act.runner import RunRequest, run_playbook
from engine.clock import SystemClock
from engine.models import RunOutcome, RunStatus
from engine.sim.fleet import SimFleet
from tests.conftest import ROOT

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
    assert "runs processes 31337" in error and "drain the node" in error
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
