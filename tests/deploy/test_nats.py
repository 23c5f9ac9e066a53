"""The NATS users of a site's own NATS, generated from gpuops/bus/auth.py: current, and
accepted by a real nats-server that then lets each role in with its own password."""

from __future__ import annotations

import importlib.util
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from gpuops.bus.conn import connect, open_bus
from gpuops.bus.server import EmbeddedNats, nats_server_binary
from gpuops.errors import BusError
from gpuops.settings import NatsSettings

ROOT = Path(__file__).resolve().parents[2]


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nats_generate", ROOT / "deploy/nats/generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generate = load_generator()
PASSWORDS = {role: f"test-{role}-password" for role in generate.ROLES}


def test_generated_files_are_current() -> None:
    for path, text in generate.outputs().items():
        assert path.read_text() == text, f"{path}: run python deploy/nats/generate.py"


def test_passwords_come_only_from_the_environment(tmp_path: Path) -> None:
    conf = tmp_path / "nats.conf"
    conf.write_text(generate.auth_conf())
    done = subprocess.run(
        [nats_server_binary(), "-t", "-c", str(conf)], capture_output=True, text=True, env={}
    )
    assert done.returncode != 0
    assert "GPUOPS_ENGINE_PASSWORD" in done.stdout + done.stderr
    assert not any(p in generate.auth_conf() for p in PASSWORDS.values())


@pytest.fixture
def site_nats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[EmbeddedNats]:
    """A real nats-server with the generated users, passwords in its environment."""
    for role, password in PASSWORDS.items():
        monkeypatch.setenv(generate.password_var(role), password)
    server = EmbeddedNats(tmp_path / "nats", config_text=generate.auth_conf()).start()
    yield server
    server.stop()


def as_role(role: str, password: str | None = None) -> NatsSettings:
    return NatsSettings(user=role, password=password or PASSWORDS[role])


async def test_engine_sets_up_jetstream_and_executor_opens_it(site_nats: EmbeddedNats) -> None:
    engine = await connect(site_nats.url, as_role("engine"))
    await engine.close()
    executor = await connect(site_nats.url, as_role("executor"), setup="open", role="executor")
    await executor.close()


async def test_a_wrong_password_is_refused(site_nats: EmbeddedNats) -> None:
    with pytest.raises(BusError, match="Authorization Violation"):
        await connect(site_nats.url, as_role("engine", "not-the-password"))


# A site NATS with per-role users: the engine sets JetStream up, the executor opens it.
async def test_executor_role_starts_on_a_site_nats(site_nats: EmbeddedNats, tmp_path: Path) -> None:
    engine = await connect(site_nats.url, as_role("engine"))
    await engine.close()
    cfg = as_role("executor").model_copy(update={"url": site_nats.url})
    async with open_bus(cfg, tmp_path / "state", role="executor") as bus:
        assert bus.nc.is_connected
