"""An operator's session against a running engine with its embedded NATS, all through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gpuops.sim.fleet import SimFleet

from tests.support import gpuops_argv

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def _gpuops(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        gpuops_argv(*args, state_dir=state),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


@pytest.mark.slow  # a running engine and a drift check through the CLI: `make test-slow`
def test_status_silence_drift_check_and_history_against_a_running_engine(tmp_path: Path) -> None:
    state = tmp_path / "state"
    fleet = SimFleet.create(tmp_path / "sim", nodes=3, gpus=2)
    inventory = str(fleet.root / "inventory")
    fleet.inject("node-002", "drift", 0, setting="persistence_mode", value=False)
    engine = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpuops.cli",
            "--state-dir",
            str(state),
            "run",
            "--inventory",
            inventory,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 30
        while not (state / "nats.url").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (state / "nats.url").exists(), "the engine started its embedded nats-server"
        inv = ("--config", str(_config(tmp_path, inventory)))
        silenced = _gpuops(state, *inv, "silence", "node:node-003", "2h", "fan swap")
        assert silenced.returncode == 0 and silenced.stdout.startswith("silence "), silenced.stderr
        status = json.loads(_gpuops(state, *inv, "status", "--json").stdout)
        assert status["counts"]["healthy"] == 3 and status["breaker"]["state"] == "closed"
        assert [s["target"] for s in status["silences"]] == ["node:node-003"]
        # No inventory given: the running engine's, from its heartbeat.
        drift = _gpuops(state, "drift-check", "--json")
        assert "the running engine's" in drift.stderr, drift.stderr
        report = json.loads(drift.stdout)
        assert report["drifted"] == ["node-002"] and report["hosts"]["node-001"] == "clean"
        deadline = time.monotonic() + 60
        while fleet.state("node-002")["gpus"][0]["persistence_mode"] is not True:
            assert time.monotonic() < deadline, "the running engine fixed the drift"
            time.sleep(0.5)
        history = _gpuops(state, *inv, "history", "--drift", "--json").stdout.splitlines()
        assert len(history) == 1 and json.loads(history[0])["body"]["drift_check"]["drifted"] == [
            "node-002"
        ]
    finally:
        engine.terminate()
        engine.wait(30)


def _config(tmp_path: Path, inventory: str) -> Path:
    path = tmp_path / "gpuops.yml"
    path.write_text(f"inventory: {inventory}\n")
    return path
