"""The systemd units: `systemd-analyze verify` accepts each, they stay hardened, and the
example settings layout loads."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gpuops.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "deploy" / "systemd"
ETC = UNITS / "etc" / "gpuops"
ROLES = ("agent", "engine", "executor")
INSTALLED_GPUOPS = "/opt/gpuops/bin/gpuops"
ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(
    ANALYZE is None, reason="systemd-analyze is not installed (apt-get install systemd)"
)
# Exponential restart backoff (RestartSteps, RestartMaxDelaySec) came with systemd 254;
# older ones ignore the keys with this warning and keep RestartSec.
NEWER_KEYS = re.compile(r"Unknown key '(RestartSteps|RestartMaxDelaySec)' in section \[Service\]")
# `systemd-analyze security` scores exposure 0-10 ("OK" below 5); the threshold is x10.
MAX_EXPOSURE = 20


def systemd_version() -> int:
    """The major version of the systemd tools here."""
    out = subprocess.run([ANALYZE or "", "--version"], capture_output=True, text=True)
    return int(out.stdout.split()[1])


def local_copy(role: str, tmp_path: Path) -> Path:
    """The unit with ExecStart on this venv's gpuops (verify wants the binary to exist)."""
    text = (UNITS / f"gpuops-{role}.service").read_text()
    assert INSTALLED_GPUOPS in text
    here = str(Path(sys.executable).parent / "gpuops")
    out = tmp_path / f"gpuops-{role}.service"
    out.write_text(text.replace(INSTALLED_GPUOPS, here))
    return out


def directives(role: str) -> dict[str, list[str]]:
    """Every `Key=value` of the unit, values in order (keys may repeat)."""
    out: dict[str, list[str]] = {}
    for line in (UNITS / f"gpuops-{role}.service").read_text().splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


@needs_analyze
@pytest.mark.parametrize("role", ROLES)
def test_unit_verifies(role: str, tmp_path: Path) -> None:
    unit = local_copy(role, tmp_path)
    done = subprocess.run(
        [ANALYZE or "", "verify", "--man=no", str(unit)], capture_output=True, text=True
    )
    messages = [m for m in (done.stdout + done.stderr).splitlines() if m.strip()]
    if systemd_version() < 254:
        messages = [m for m in messages if not NEWER_KEYS.search(m)]
    assert done.returncode == 0, messages
    assert messages == []


@needs_analyze
@pytest.mark.parametrize("role", ROLES)
def test_unit_exposure_is_low(role: str, tmp_path: Path) -> None:
    unit = local_copy(role, tmp_path)
    done = subprocess.run(
        [ANALYZE or "", "security", "--offline=yes", f"--threshold={MAX_EXPOSURE}", str(unit)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-2000:]


@pytest.mark.parametrize("role", ROLES)
def test_unit_runs_unprivileged_and_restarts(role: str) -> None:
    d = directives(role)
    for key, value in {
        "User": "gpuops",
        "Restart": "on-failure",
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "StateDirectory": "gpuops",
        "CapabilityBoundingSet": "",
        "WantedBy": "multi-user.target",
    }.items():
        assert d.get(key) == [value], f"{role}: {key}={d.get(key)}"
    command = "agent" if role == "agent" else "run"
    assert d["ExecStart"][0].split()[:2] == [INSTALLED_GPUOPS, command]


def test_only_the_agent_sees_gpus() -> None:
    agent = directives("agent")
    assert "PrivateDevices" not in agent
    assert agent["DevicePolicy"] == ["closed"]
    assert "char-nvidia-frontend rw" in agent["DeviceAllow"]
    for role in ("engine", "executor"):
        assert directives(role)["PrivateDevices"] == ["yes"]


def test_signing_key_and_ssh_key_come_as_credentials() -> None:
    for role in ("engine", "executor"):
        d = directives(role)
        assert "intent.key:/etc/gpuops/keys/intent.key" in d["LoadCredential"]
        assert "GPUOPS_SIGNING_KEY=%d/intent.key" in d["Environment"]
    executor = directives("executor")
    assert "ANSIBLE_PRIVATE_KEY_FILE=%d/ssh-key" in executor["Environment"]
    assert "LoadCredential" not in directives("agent")


def env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of an EnvironmentFile."""
    lines = [ln for ln in path.read_text().splitlines() if ln and not ln.startswith("#")]
    return dict(ln.split("=", 1) for ln in lines)


@pytest.mark.parametrize("role", ROLES)
def test_example_settings_load_for_each_role(role: str) -> None:
    unit_env = [e for e in directives(role)["Environment"] if not e.startswith("GPUOPS_CONFIG")]
    environ = {**dict(e.split("=", 1) for e in unit_env), **env_file(ETC / f"{role}.env")}
    environ = {k: v.replace("%d", "/run/credentials/x") for k, v in environ.items()}
    settings = load_settings(ETC / "gpuops.yml", environ=environ)
    assert settings.nats.url and settings.nats.url.startswith("tls://")
    assert settings.nats.user and settings.nats.password is not None
    assert str(settings.state_dir) == "/var/lib/gpuops"
    if role != "agent":
        assert settings.signing_key == Path("/run/credentials/x/intent.key")
