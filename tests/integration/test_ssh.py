"""A playbook over real SSH: sshd on a loopback port with a throwaway key.

Also: a host whose sshd is gone is recorded as unreachable, not as success or a crash;
host keys are checked (an unknown host is refused, accept-new enrols it, a changed key
is refused).
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from gpuops.act.playbooks import resolve
from gpuops.act.runenv import RunEnv
from gpuops.act.runner import RunRequest, run_hosts, run_playbook
from gpuops.clock import SystemClock
from gpuops.models import ActionSpec, Intent, RunStatus
from gpuops.sim.fleet import SimFleet

from tests.conftest import ROOT, calls
from tests.support import free_port

pytestmark = pytest.mark.integration
SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if Path("/usr/sbin/sshd").exists() else None)


@pytest.fixture
def sshd(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], int, Path]]:
    if SSHD is None:
        pytest.skip("sshd is not installed (scripts/ci-setup.sh installs openssh-server)")
    keys = tmp_path / "ssh"
    keys.mkdir()
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / "host")], check=True
    )
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / "client")], check=True
    )
    shutil.copy(keys / "client.pub", keys / "authorized_keys")
    port = free_port()
    config = keys / "sshd_config"
    config.write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {keys / 'host'}\n"
        f"AuthorizedKeysFile {keys / 'authorized_keys'}\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPubkeyAuthentication yes\nStrictModes no\nUsePAM no\n"
        f"PidFile {keys / 'sshd.pid'}\nPermitRootLogin prohibit-password\n"
    )
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(config)], stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail(f"sshd did not start: {proc.stderr.read().decode() if proc.stderr else ''}")
    yield proc, port, keys
    proc.terminate()
    proc.wait(10)


def _inventory(fleet: SimFleet, port: int, keys: Path, path: Path) -> Path:
    node = fleet.node_dir("node-001")
    host = {
        "ansible_host": "127.0.0.1",
        "ansible_port": port,
        "ansible_user": getpass.getuser(),
        "ansible_connection": "ssh",
        "ansible_ssh_private_key_file": str(keys / "client"),
        "ansible_ssh_common_args": "-o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null",
        # No shared master connection: a stopped sshd must look like a host that went away.
        "ansible_ssh_args": "-o ControlMaster=no -o ConnectTimeout=5",
        "ansible_python_interpreter": sys.executable,
        "nvidia_smi_bin": str(node / "bin" / "nvidia-smi"),
        "gpu_power_policy_w": 700,
    }
    path.write_text(yaml.safe_dump({"all": {"hosts": {"node-001": host}}}))
    return path


def _request(inventory: Path, env: RunEnv | None = None) -> RunRequest:
    intent = Intent(
        key="ssh-test",
        rule="ssh",
        node="node-001",
        gpu=1,
        action=ActionSpec(playbook="power_limit.yml"),
        event_id="e",
        event_ts=0.0,
        decided_at=0.0,
    )
    version = resolve(ROOT / "playbooks", "power_limit.yml", None, ROOT / "playbooks")
    return RunRequest.for_intents([intent], version, inventory, 120, env=env)


def test_playbook_over_real_ssh_then_unreachable_when_sshd_stops(
    tmp_path: Path, sshd: tuple[subprocess.Popen[bytes], int, Path]
) -> None:
    proc, port, keys = sshd
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=2)
    fleet.inject("node-001", "power_limit", 1, watts=450)
    inventory = _inventory(fleet, port, keys, tmp_path / "hosts.yml")

    ok = run_playbook(_request(inventory), SystemClock())
    assert ok.status is RunStatus.SUCCESSFUL, ok.error
    assert ["-i", "1", "-pl", "700.0"] in calls(fleet, "node-001", "nvidia-smi")
    assert fleet.state("node-001")["gpus"][1]["power_limit_w"] == 700.0

    proc.terminate()
    proc.wait(10)
    gone = run_playbook(_request(inventory), SystemClock())
    assert gone.status is RunStatus.UNREACHABLE
    assert gone.stats["node-001"].get("dark") == 1


def _site_inventory(fleet: SimFleet, port: int, keys: Path, path: Path) -> Path:
    """The host as a site writes it: no ssh options of its own, so the executor's apply."""
    _inventory(fleet, port, keys, path)
    hosts = yaml.safe_load(path.read_text())
    for option in ("ansible_ssh_common_args", "ansible_ssh_args"):
        del hosts["all"]["hosts"]["node-001"][option]
    path.write_text(yaml.safe_dump(hosts))
    return path


@pytest.fixture
def control_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Where ansible keeps its shared ssh connections (short: a socket path is bounded);
    each is closed at the end, and between runs that must verify the host afresh."""
    where = Path(tempfile.mkdtemp(prefix="gpuops-cp-"))
    monkeypatch.setenv("ANSIBLE_SSH_CONTROL_PATH_DIR", str(where))
    yield where
    _close_masters(where)
    shutil.rmtree(where, ignore_errors=True)


def _close_masters(where: Path) -> None:
    for socket_path in where.iterdir():
        subprocess.run(
            ["ssh", "-O", "exit", "-o", f"ControlPath={socket_path}", "node"],
            capture_output=True,
            timeout=10,
        )


def test_host_keys_are_checked_and_accept_new_enrols_only_a_new_host(
    tmp_path: Path, sshd: tuple[subprocess.Popen[bytes], int, Path], control_dir: Path
) -> None:
    _proc, port, keys = sshd
    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=2)
    inventory = _site_inventory(fleet, port, keys, tmp_path / "hosts.yml")
    known = tmp_path / "state" / "ssh" / "known_hosts"
    allow = ("ANSIBLE_SSH_CONTROL_PATH_DIR",)

    (unknown,) = run_hosts(_request(inventory, RunEnv(allow, "strict", known)), SystemClock())
    assert unknown.status is RunStatus.UNREACHABLE, unknown.error
    assert "Host key verification failed" in (unknown.error or "")
    assert f"enrol it in {known}" in (unknown.error or ""), "what to do"
    assert calls(fleet, "node-001", "nvidia-smi") == [], "nothing ran on an unknown host"

    (enrolled,) = run_hosts(_request(inventory, RunEnv(allow, "accept-new", known)), SystemClock())
    assert enrolled.status is RunStatus.SUCCESSFUL, enrolled.error
    host_key = (keys / "host.pub").read_text().split()[1]
    (line,) = known.read_text().splitlines()
    assert line.split()[1:] == ["ssh-ed25519", host_key], "the host's own key, recorded"

    _close_masters(control_dir)  # a shared connection would skip the check below
    other_key = (keys / "client.pub").read_text().split()[1]
    known.write_text(line.replace(host_key, other_key) + "\n")  # as if the host changed
    (changed,) = run_hosts(_request(inventory, RunEnv(allow, "accept-new", known)), SystemClock())
    assert changed.status is RunStatus.UNREACHABLE, "accept-new refuses a changed key"
    assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in (changed.error or "")
    assert f"enrol it in {known}" in (changed.error or "")
