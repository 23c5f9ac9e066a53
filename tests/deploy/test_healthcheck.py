"""The image's HEALTHCHECK script against the engine's real HTTP server."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from gpuops.http import HttpServer
from prometheus_client import CollectorRegistry

from tests.support import free_port

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "healthcheck.py"
GPUOPS = "/opt/gpuops/bin/gpuops"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("healthcheck", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


healthcheck = load_script()


class Health:
    """A health source the test switches, as the engine's would on a NATS outage."""

    ok = True

    def __call__(self) -> tuple[bool, dict[str, Any]]:
        return (True, {}) if self.ok else (False, {"nats": "not connected; reconnecting"})


@pytest.fixture
async def served() -> AsyncIterator[tuple[Health, int]]:
    health = Health()
    server = HttpServer(CollectorRegistry(), health)
    port = await server.start("127.0.0.1:0")
    yield health, port
    await server.stop()


@pytest.fixture(autouse=True)
def no_gpuops_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("GPUOPS_")]:
        monkeypatch.delenv(name)


def cmdline(tmp_path: Path, *argv: str) -> str:
    """A file like /proc/1/cmdline for a container started with argv."""
    path = tmp_path / "cmdline"
    path.write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    return str(path)


async def check(path: str) -> int:
    """The script's answer; in a thread, so the server in this loop can reply."""
    code: int = await asyncio.to_thread(healthcheck.main, path)
    return code


async def test_script_healthy_then_degraded(served: tuple[Health, int], tmp_path: Path) -> None:
    """Run as the image runs it: a separate Python, PID 1's command line read from a file."""
    health, port = served
    path = cmdline(tmp_path, GPUOPS, "run", "--role", "engine", "--http", f"0.0.0.0:{port}")
    for ok, code in ((True, 0), (False, 1)):
        health.ok = ok
        proc = await asyncio.create_subprocess_exec(sys.executable, str(SCRIPT), path)
        assert await proc.wait() == code


async def test_address_from_settings_file_and_environment(
    served: tuple[Health, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    health, port = served
    health.ok = False
    path = cmdline(tmp_path, GPUOPS, "run")
    settings = tmp_path / "gpuops.yml"
    settings.write_text(f"http: 127.0.0.1:{port}\n")
    monkeypatch.setenv("GPUOPS_CONFIG", str(settings))
    assert await check(path) == 1
    monkeypatch.delenv("GPUOPS_CONFIG")
    monkeypatch.setenv("GPUOPS_HTTP", f"127.0.0.1:{port}")
    assert await check(path) == 1
    health.ok = True
    assert await check(path) == 0


def test_flags_win_over_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUOPS_HTTP", "127.0.0.1:1")
    argv = [GPUOPS, "run", "--http=[::]:8080"]
    assert healthcheck.health_url(argv, dict(os.environ)) == "http://127.0.0.1:8080/healthz"


async def test_nothing_listening_is_unhealthy(tmp_path: Path) -> None:
    port = free_port()
    assert await check(cmdline(tmp_path, GPUOPS, "run", f"--http=127.0.0.1:{port}")) == 1


async def test_agent_without_http_is_healthy(tmp_path: Path) -> None:
    assert await check(cmdline(tmp_path, GPUOPS, "agent", "--node", "n1")) == 0


async def test_bad_settings_are_unhealthy(tmp_path: Path) -> None:
    settings = tmp_path / "gpuops.yml"
    settings.write_text("no_such_setting: 1\n")
    assert await check(cmdline(tmp_path, GPUOPS, "--config", str(settings), "run")) == 1
