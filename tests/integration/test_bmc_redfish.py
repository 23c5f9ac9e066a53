"""The BMC playbooks against a real Redfish BMC: sushy-tools' emulator, driven by
community.general's Redfish modules through gpuops's own runner, as a site's runs are."""

from __future__ import annotations

import importlib.util
import threading
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
from tests.peers import redfish
from tests.peers.redfish import Bmc

pytestmark = pytest.mark.integration

WRONG_PASSWORD = "Wr0ng-redfish-Zq81"
HOLD_S = 1


def _skip_without_the_peer() -> None:
    why = redfish.missing()
    if why is not None:
        pytest.skip(why)
    try:
        found = importlib.util.find_spec("ansible_collections.community.general") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        pytest.skip("community.general is not installed (the `ansible` bundle installs it)")


@pytest.fixture
def bmc(tmp_path: Path) -> Iterator[Bmc]:
    """An emulated BMC whose system is on."""
    _skip_without_the_peer()
    with redfish.redfish_bmc(tmp_path / "bmc") as running:
        yield running


@pytest.fixture
def bmc_off(tmp_path: Path) -> Iterator[Bmc]:
    """An emulated BMC whose system is off (its power cycle is only a power on)."""
    _skip_without_the_peer()
    with redfish.redfish_bmc(tmp_path / "bmc", power="Off") as running:
        yield running


def _fleet(tmp_path: Path, bmc: Bmc, **overrides: object) -> SimFleet:
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=1)
    fleet.write_inventory(
        fleet.root / "inventory",
        group_vars={
            "bmc": "redfish",
            "bmc_address": bmc.address,
            "bmc_user": bmc.user,
            "bmc_password": bmc.password,
            "bmc_ca_path": str(bmc.ca),
            "reboot_method": "bmc",
            "bmc_off_hold_s": HOLD_S,
            "bmc_poll_s": 0.5,
            "bmc_timeout_s": 30,
            **overrides,
        },
    )
    return fleet


def _run(tmp_path: Path, fleet: SimFleet, playbook: str) -> RunOutcome:
    """The playbook through the executor's runner, its evidence kept under tmp_path/runs."""
    request = RunRequest(
        key="t",
        rule="test",
        node="node-001",
        playbook=resolve(ROOT / "playbooks", playbook, None, fleet.root / "refs"),
        playbook_name=playbook,
        inventory=fleet.root / "inventory",
        timeout_s=120,
        limit="node-001",
        extravars={"gpuops": {"node": "node-001", "intent_key": f"k-{playbook}"}},
        run_id=new_run_id(time.time()),
        evidence=Evidence(tmp_path / "runs"),
    )
    return run_playbook(request, SystemClock())


class PowerWatch:
    """The emulator's PowerState read every 0.1 s from a thread: each change, timed."""

    def __init__(self, bmc: Bmc) -> None:
        self.bmc = bmc
        self.seen: list[tuple[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            state = self.bmc.power_state()
            if not self.seen or self.seen[-1][0] != state:
                self.seen.append((state, time.monotonic()))
            self._stop.wait(0.1)

    def __enter__(self) -> PowerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    @property
    def states(self) -> list[str]:
        """The states in the order the emulator reported them."""
        return [state for state, _ in self.seen]


def test_reboot_power_cycles_the_emulated_system_off_then_on(tmp_path: Path, bmc: Bmc) -> None:
    fleet = _fleet(tmp_path, bmc, redfish_system_id=redfish.SYSTEM_UUID)
    with PowerWatch(bmc) as watch:
        outcome = _run(tmp_path, fleet, "reboot.yml")
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    assert watch.states == ["On", "Off", "On"], watch.seen
    (_, off), (_, on) = watch.seen[1], watch.seen[2]
    assert on - off >= HOLD_S, "the power stayed off at least bmc_off_hold_s"


@pytest.mark.slow  # a reprovision's power cycles on the emulator: `make test-slow`
def test_reprovision_inserts_virtual_media_and_boots_it_once(tmp_path: Path, bmc_off: Bmc) -> None:
    # The manager's Id is its system's in sushy-tools.
    fleet = _fleet(
        tmp_path, bmc_off, bmc_media_image=bmc_off.image_url, redfish_manager_id=redfish.SYSTEM_UUID
    )
    outcome = _run(tmp_path, fleet, "reprovision.yml")
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    cd = bmc_off.cd()
    assert (cd["Image"], cd["Inserted"], cd["ImageName"]) == (
        bmc_off.image_url,
        True,
        redfish.IMAGE,
    ), "the emulator fetched the image"
    # sushy-tools reports every override as Continuous (it ignores BootSourceOverrideEnabled),
    # so only the target can be read back; redfish_command's SetOneTimeBoot sends Once.
    assert bmc_off.boot()["BootSourceOverrideTarget"] == "Cd"
    assert bmc_off.power_state() == "On", "the system was off, so its power cycle powered it on"


@pytest.mark.slow  # a reprovision's power cycles on the emulator: `make test-slow`
def test_reprovision_replaces_an_image_a_former_reinstall_left(
    tmp_path: Path, bmc_off: Bmc
) -> None:
    bmc_off.insert(bmc_off.url_of(redfish.FORMER_IMAGE))
    fleet = _fleet(tmp_path, bmc_off, bmc_media_image=bmc_off.image_url)
    outcome = _run(tmp_path, fleet, "reprovision.yml")
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    cd = bmc_off.cd()
    assert (cd["Image"], cd["Inserted"]) == (bmc_off.image_url, True), cd
    assert bmc_off.boot()["BootSourceOverrideTarget"] == "Cd"


@pytest.mark.slow  # a reprovision's power cycles on the emulator: `make test-slow`
def test_reprovision_without_an_image_boots_from_the_network_once(
    tmp_path: Path, bmc_off: Bmc
) -> None:
    fleet = _fleet(tmp_path, bmc_off)
    outcome = _run(tmp_path, fleet, "reprovision.yml")
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    assert bmc_off.boot()["BootSourceOverrideTarget"] == "Pxe"
    assert bmc_off.cd()["Inserted"] is False, "no virtual media without bmc_media_image"
    assert bmc_off.power_state() == "On"


@pytest.mark.slow  # the emulator's log, collected (IPMI's stays in make test): `make test-slow`
def test_collect_diagnostics_saves_what_the_bmc_said_of_its_log(tmp_path: Path, bmc: Bmc) -> None:
    diagnostics = tmp_path / "diagnostics"
    fleet = _fleet(tmp_path, bmc, diagnostics_dir=str(diagnostics))
    outcome = _run(tmp_path, fleet, "collect_diagnostics.yml")
    assert outcome.status is RunStatus.SUCCESSFUL, outcome.error
    sel = (diagnostics / "node-001" / "bmc-sel.txt").read_text()
    # sushy-tools serves no LogServices: the file says so, in the BMC's (module's) words.
    assert sel.startswith("BMC event log unavailable: "), sel
    assert bmc.address in sel and "LogServices resource not found" in sel, sel


def test_a_wrong_bmc_password_fails_clearly_and_is_never_written(tmp_path: Path, bmc: Bmc) -> None:
    fleet = _fleet(tmp_path, bmc, bmc_password=WRONG_PASSWORD)
    outcome = _run(tmp_path, fleet, "reboot.yml")
    assert outcome.status is RunStatus.FAILED
    error = outcome.error or ""
    assert bmc.address in error and "HTTP Error 401" in error, error
    assert "check bmc_user and bmc_password" in error, error
    assert bmc.power_state() == "On", "nothing was done to the system"
    secrets = {WRONG_PASSWORD, bmc.password}
    files = [p for p in (tmp_path / "runs").rglob("*") if p.is_file()]
    assert files, "the run kept its evidence"
    leaks = [f"{p}: {s}" for p in files for s in secrets if s.encode() in p.read_bytes()]
    assert leaks == []
    assert not any(s in error for s in secrets)


def test_a_bmc_certificate_from_an_unknown_ca_is_refused_with_what_to_do(
    tmp_path: Path, bmc: Bmc
) -> None:
    fleet = _fleet(tmp_path, bmc, bmc_ca_path=None)
    outcome = _run(tmp_path, fleet, "reboot.yml")
    assert outcome.status is RunStatus.FAILED
    error = outcome.error or ""
    assert "CERTIFICATE_VERIFY_FAILED" in error and "set bmc_ca_path" in error, error
    assert bmc.power_state() == "On", "certificates are validated unless a site says not to"
