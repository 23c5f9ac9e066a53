"""The container image: it builds from the Dockerfile and its gpuops runs, as gpuops."""

from __future__ import annotations

import shutil
import subprocess
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
pytestmark = pytest.mark.slow


def docker_unavailable() -> str | None:
    """Why no image can be built here, or None when a Docker daemon answers."""
    if shutil.which("docker") is None:
        return "no docker client on PATH"
    try:
        done = subprocess.run(["docker", "info"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "`docker info` did not answer within 30 s"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"no Docker daemon answers `docker info`: {last}"
    return None


@pytest.fixture(scope="module")
def image() -> Iterator[str]:
    why = docker_unavailable()
    if why is not None:
        pytest.skip(why)
    tag = f"gpuops-test:{uuid.uuid4().hex[:12]}"
    build = subprocess.run(
        ["docker", "build", "--tag", tag, str(ROOT)], capture_output=True, text=True, timeout=1800
    )
    assert build.returncode == 0, build.stderr[-4000:]
    yield tag
    subprocess.run(["docker", "image", "rm", "--force", tag], capture_output=True, timeout=120)


def run(image: str, *args: str, entrypoint: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = ["docker", "run", "--rm", "--network", "none"]
    cmd += ["--entrypoint", entrypoint] if entrypoint else []
    return subprocess.run([*cmd, image, *args], capture_output=True, text=True, timeout=300)


def test_gpuops_version_runs_in_the_image(image: str) -> None:
    done = run(image, "--version")
    assert done.returncode == 0, done.stderr
    assert VERSION in done.stdout


def test_runs_as_the_gpuops_user(image: str) -> None:
    done = run(image, "-c", "id -u; id -g; echo $HOME", entrypoint="/bin/sh")
    assert done.stdout.split() == ["10001", "10001", "/var/lib/gpuops"]


def test_has_ssh_and_no_build_tools(image: str) -> None:
    done = run(
        image,
        "-c",
        "command -v ssh ipmitool gpuops; for t in gcc cc make git; do command -v $t; done; true",
        entrypoint="/bin/sh",
    )
    found = [Path(p).name for p in done.stdout.split()]
    assert found == ["ssh", "ipmitool", "gpuops"]


def test_healthcheck_is_declared(image: str) -> None:
    done = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{json .Config.Healthcheck.Test}}", image],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "healthcheck.py" in done.stdout
