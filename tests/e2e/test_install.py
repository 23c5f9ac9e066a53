"""A wheel installed (not editable) into a fresh venv outside the checkout works on its own:
the same steps the Dockerfile takes (`pip wheel --no-deps -w dist .`, then
`pip install dist/gpuops-*.whl` in a new venv)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
# What a source checkout holds beyond the source: never part of a build.
NOT_SOURCE = (".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", ".*_cache")


def _run(
    args: list[str | Path], cwd: Path, timeout: float = 900
) -> subprocess.CompletedProcess[str]:
    # No PYTHONPATH and a cwd outside the checkout: only the installed copy can be imported.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GPUOPS_CONFIG")}
    return subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin/ of a fresh venv with the wheel built from this checkout installed."""
    work = tmp_path_factory.mktemp("install")
    # A copy of the source keeps the build's build/ and egg-info out of the checkout.
    source = work / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    built = _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", work / "dist", source], work
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    (wheel,) = (work / "dist").glob("gpuops-*.whl")
    venv = work / "venv"
    made = _run([sys.executable, "-m", "venv", venv], work)
    assert made.returncode == 0, made.stderr
    # --no-compile: byte-compiling Ansible would take minutes and proves nothing here.
    done = _run([venv / "bin" / "pip", "install", "--no-compile", wheel], work)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return venv / "bin"


def test_the_installed_package_is_not_the_checkout(installed: Path, tmp_path: Path) -> None:
    code = "import gpuops, gpuops.shipped as s; print(gpuops.__file__); print(s.root())"
    done = _run([installed / "python", "-c", code], tmp_path)
    assert done.returncode == 0, done.stderr
    module, shipped_root = done.stdout.splitlines()
    assert module.startswith(str(installed.parent)) and not module.startswith(str(ROOT))
    assert shipped_root.endswith("gpuops/_shipped")


def test_version_and_shipped_rules_outside_a_site(installed: Path, tmp_path: Path) -> None:
    version = _run([installed / "gpuops", "--version"], tmp_path)
    assert version.returncode == 0, version.stderr
    assert version.stdout.splitlines()[0] == "gpuops 0.1.0"
    assert version.stdout.splitlines()[1].startswith("shipped playbooks ")
    validate = _run([installed / "gpuops", "validate"], tmp_path)
    assert validate.returncode == 0, validate.stdout + validate.stderr
    assert validate.stdout.startswith("checking shipped rules/ of gpuops 0.1.0 (")
    assert "\nok: " in validate.stdout


def test_the_demo_scenarios_ship(installed: Path, tmp_path: Path) -> None:
    code = (
        "from gpuops.sim.scenario import load_scenario\n"
        "nodes = [f'node-{i:03d}' for i in range(1, 17)]\n"
        "print(load_scenario('demo', nodes).name, load_scenario('storm', nodes).name)"
    )
    done = _run([installed / "python", "-c", code], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["demo", "storm"]


def test_init_then_validate_test_rules_and_replay_in_the_site(
    installed: Path, tmp_path: Path
) -> None:
    gpuops = installed / "gpuops"
    init = _run([gpuops, "init", "site"], tmp_path)
    assert init.returncode == 0, init.stderr
    assert init.stdout.startswith("site created in site: ")
    site = tmp_path / "site"
    validate = _run([gpuops, "validate"], site)
    assert validate.returncode == 0, validate.stdout + validate.stderr
    assert validate.stdout.startswith(f"checking site rules/ ({site / 'rules'})")
    assert "ok: " in validate.stdout
    tests = _run([gpuops, "test-rules"], site)
    assert tests.returncode == 0, tests.stdout[-3000:]
    assert tests.stdout.splitlines()[0].startswith("running site tests/rules/ (")
    assert tests.stdout.splitlines()[-1].endswith(" passed, 0 failed")
    replay = _run([gpuops, "replay", "recordings/example.jsonl", "--json"], site)
    assert replay.returncode == 0, replay.stderr
    rows = [json.loads(line) for line in replay.stdout.splitlines()]
    actions = {(a["node"], a["action"]) for a in rows if a["kind"] == "action"}
    assert {("gpu-a01-01", "power_limit.yml"), ("gpu-a01-02", "reboot.yml")} <= actions
    assert "31 events, 0 unreadable" in replay.stderr


def test_the_console_ships_its_pages_and_chart_library(installed: Path, tmp_path: Path) -> None:
    code = (
        "from gpuops.console.web import STATIC, TEMPLATES, UPLOT\n"
        "names = ['fleet.html', 'node.html', 'now.html', 'login.html', 'base.html']\n"
        "assert all((TEMPLATES / n).is_file() for n in names), names\n"
        "scripts = ['fleet.js', 'node.js', 'now.js', 'console.css']\n"
        "assert all((STATIC / n).is_file() for n in scripts), scripts\n"
        "vendor = STATIC / 'vendor'\n"
        "for suffix in ('.iife.min.js', '.min.css', '.LICENSE'):\n"
        "    assert (vendor / (UPLOT + suffix)).is_file(), suffix\n"
        "print(TEMPLATES)"
    )
    done = _run([installed / "python", "-c", code], tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().startswith(str(installed.parent))
