"""The playbooks' IPMI path against a real BMC: OpenIPMI's ipmi_sim, the real ipmitool.

Each run goes through gpuops's runner on a simulated node (its nvidia-smi and scontrol are
the fleet's shims), whose BMC is an ipmi_sim on loopback (tests/peers/ipmi.py). What the
BMC did is read from the simulator's side: its chassis program logs every change.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from gpuops.act.evidence import Evidence, new_run_id
from gpuops.act.playbooks import resolve
from gpuops.act.runner import RunRequest, run_playbook
from gpuops.clock import SystemClock
from gpuops.models import RunOutcome, RunStatus
from gpuops.sim.fleet import SimFleet

from tests.conftest import ROOT
from tests.peers.ipmi import Bmc, ipmi_bmc

pytestmark = pytest.mark.integration

WRONG = "Wr0ng-bmc-Zq81"


@pytest.fixture
def bmc(tmp_path: Path) -> Iterator[Bmc]:
    with ipmi_bmc(tmp_path) as running:
        yield running


def _fleet(tmp_path: Path, bmc: Bmc, password: str | None = None) -> SimFleet:
    """One simulated node whose BMC is `bmc`, spoken to by the real ipmitool."""
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=1)
    fleet.write_inventory(
        fleet.root / "inventory",
        group_vars={
            "bmc": "ipmi",
            "bmc_address": bmc.address,
            "bmc_port": bmc.port,
            "bmc_user": bmc.user,
            "bmc_password": password or bmc.password,
            "ipmitool_bin": bmc.ipmitool,
            "ipmi_cipher_suite": bmc.cipher_suite,
            "reboot_method": "bmc",
            "bmc_off_hold_s": 1,
            "bmc_poll_s": 0.5,
            "diagnostics_dir": str(tmp_path / "diagnostics"),
        },
    )
    return fleet


def _run(
    fleet: SimFleet, tmp_path: Path, playbook: str, check_mode: bool = False
) -> tuple[RunOutcome, Path]:
    """The playbook through the runner; its outcome and its kept artifacts (unscrubbed)."""
    run_id = new_run_id(time.time())
    evidence = Evidence(root=tmp_path / "runs")
    request = RunRequest(
        key="t",
        rule="test",
        node="node-001",
        playbook=resolve(ROOT / "playbooks", playbook, None, tmp_path / "refs"),
        playbook_name=playbook,
        inventory=fleet.root / "inventory",
        timeout_s=120,
        limit="node-001",
        extravars={"gpuops": {"node": "node-001", "intent_key": f"k-{playbook}"}},
        run_id=run_id,
        evidence=evidence,
        check_mode=check_mode,
    )
    return run_playbook(request, SystemClock()), evidence.root / run_id


def test_reboot_power_cycles_the_emulated_system_off_then_on(tmp_path: Path, bmc: Bmc) -> None:
    outcome, _ = _run(_fleet(tmp_path, bmc), tmp_path, "reboot.yml")
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    assert bmc.changes() == ["power 0", "power 1"]
    assert bmc.power() == "on"


@pytest.mark.slow  # a reprovision's power cycle on ipmi_sim: `make test-slow`
def test_reprovision_sets_one_time_pxe_boot_before_the_power_cycle(
    tmp_path: Path, bmc: Bmc
) -> None:
    outcome, _ = _run(_fleet(tmp_path, bmc), tmp_path, "reprovision.yml")
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    assert bmc.changes() == ["boot pxe", "power 0", "power 1"]


def test_collect_diagnostics_saves_the_bmcs_real_event_log(tmp_path: Path, bmc: Bmc) -> None:
    outcome, _ = _run(_fleet(tmp_path, bmc), tmp_path, "collect_diagnostics.yml")
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    sel = (tmp_path / "diagnostics" / "node-001" / "bmc-sel.txt").read_text().splitlines()
    # The simulator's one entry, as ipmitool decodes it; nothing else ipmitool printed.
    assert len(sel) == 1, sel
    fields = [f.strip() for f in sel[0].split("|")]
    assert fields[0] == "1" and fields[-3:] == ["Memory #0x01", "Uncorrectable ECC", "Asserted"]
    assert bmc.changes() == [], "reading the log changes nothing"


@pytest.mark.slow  # every BMC read of reboot.yml and reprovision.yml: `make test-slow`
def test_check_mode_reads_the_bmc_and_changes_nothing(tmp_path: Path, bmc: Bmc) -> None:
    fleet = _fleet(tmp_path, bmc)
    outcome, kept = _run(fleet, tmp_path, "collect_diagnostics.yml", check_mode=True)
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    told = "\n".join(p.read_text() for p in kept.rglob("stdout") if p.is_file())
    assert "Uncorrectable ECC" in told, "the SEL was read for real in check mode"
    assert "event log unavailable" not in told
    outcome, _ = _run(fleet, tmp_path, "reboot.yml", check_mode=True)
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    assert bmc.changes() == [], "a check cycles no power"
    assert bmc.power() == "on"


def test_a_wrong_bmc_password_fails_clearly_and_leaves_no_password_behind(
    tmp_path: Path, bmc: Bmc
) -> None:
    outcome, artifacts = _run(_fleet(tmp_path, bmc, password=WRONG), tmp_path, "reboot.yml")
    assert outcome.status is RunStatus.FAILED
    error = outcome.error or ""
    assert f"the BMC of node-001 ({bmc.address}:{bmc.port}) refused" in error, error
    assert "Unable to establish IPMI v2 / RMCP+ session" in error, error
    assert bmc.changes() == [] and bmc.power() == "on", "the BMC let nothing through"
    files = [p for p in artifacts.rglob("*") if p.is_file()]
    assert any(p.name == "stdout" for p in files), "the run's evidence was kept"
    leaked = [
        f"{p.relative_to(artifacts)}: {secret}"
        for p in files
        for secret in (WRONG, bmc.password)
        if secret.encode() in p.read_bytes()
    ]
    assert leaked == []
    assert WRONG not in error and bmc.password not in error


@pytest.mark.slow  # a reboot through ipmi_sim, watched: `make test-slow`
def test_the_bmc_password_is_in_no_process_argv(tmp_path: Path, bmc: Bmc) -> None:
    outcome, _ = _run(_fleet(tmp_path, bmc), tmp_path, "reboot.yml")
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    # Noted by the simulator's chassis program while ipmitool waited for each answer.
    seen = bmc.argv_seen()
    calls = [line.split() for line in seen.splitlines() if line.startswith(bmc.ipmitool)]
    changes = [argv[argv.index("/dev/stdin") + 1 :] for argv in calls if "/dev/stdin" in argv]
    assert [c for c in changes if c[-1] != "status"] == [
        ["chassis", "power", "off"],
        ["chassis", "power", "on"],
    ], calls
    assert bmc.password not in seen
