"""The image's HEALTHCHECK script against the engine's real HTTP server."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gpuops.http import HttpServer

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "docker" / "healthcheck.py"


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


async def check(tmp_path: Path, argv: list[str], **env: str) -> int:
    """Run the script as the container would, PID 1's command line being argv."""
    cmdline = tmp_path / "cmdline"
    cmdline.write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPUOPS_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(SCRIPT), str(cmdline), env={**clean, **env}
    )
    return await proc.wait()


async def test_http_flag_healthy_then_degraded(served: tuple[Health, int], tmp_path: Path) -> None:
    health, port = served
    argv = ["/opt/gpuops/bin/gpuops", "run", "--role", "engine", "--http", f"0.0.0.0:{port}"]
    assert await check(tmp_path, argv) == 0
    health.ok = False
    assert await check(tmp_path, argv) == 1


async def test_address_from_settings_file_and_environment(
    served: tuple[Health, int], tmp_path: Path
) -> None:
    _, port = served
    argv = ["/opt/gpuops/bin/gpuops", "run"]
    settings = tmp_path / "gpuops.yml"
    settings.write_text(f"http: 127.0.0.1:{port}\n")
    assert await check(tmp_path, argv, GPUOPS_CONFIG=str(settings)) == 0
    assert await check(tmp_path, argv, GPUOPS_HTTP=f"127.0.0.1:{port}") == 0


async def test_nothing_listening_is_unhealthy(tmp_path: Path) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    argv = ["/opt/gpuops/bin/gpuops", "run", f"--http=127.0.0.1:{port}"]
    assert await check(tmp_path, argv) == 1


async def test_agent_without_http_is_healthy(tmp_path: Path) -> None:
    assert await check(tmp_path, ["/opt/gpuops/bin/gpuops", "agent", "--node", "n1"]) == 0


async def test_bad_settings_are_unhealthy(tmp_path: Path) -> None:
    settings = tmp_path / "gpuops.yml"
    settings.write_text("no_such_setting: 1\n")
    argv = ["/opt/gpuops/bin/gpuops", "--config", str(settings), "run"]
    assert await check(tmp_path, argv) == 1
