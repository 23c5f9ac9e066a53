"""The gpuops command as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
GPUOPS = [sys.executable, "-m", "engine.cli"]


def _gpuops(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*GPUOPS, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT
    )


def test_demo_closes_the_loop_for_every_fault(tmp_path: Path) -> None:
    done = _gpuops("--state-dir", str(tmp_path), "demo", "--json-summary", timeout=170)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    assert summary["ok"] is True
    assert {f["rule"] for f in summary["faults"]} == {
        "gpu-overheat",
        "power-limit-below-policy",
        "xid-79-gpu-lost",
    }
    for fault in summary["faults"]:
        assert fault["run"] == "successful" and fault["outcome"] == "recovered", fault
        assert fault["detected_after_s"] is not None
    assert summary["runs"] == 3
    history = _gpuops("--state-dir", str(tmp_path / "demo"), "history", "--json")
    assert history.returncode == 0, history.stderr
    runs = [json.loads(line) for line in history.stdout.splitlines() if '"type": "run"' in line]
    assert len(runs) == 3


def test_validate_reports_file_line_rule_and_exits_1() -> None:
    bad = ROOT / "tests" / "unit" / "bad_rules" / "lambda.yml"
    done = _gpuops("validate", str(bad))
    assert done.returncode == 1
    assert done.stdout.strip() == f"{bad}:4: rule sneaky: when: lambdas are not allowed"


def test_validate_accepts_the_shipped_rules() -> None:
    done = _gpuops("validate", "rules")
    assert done.returncode == 0 and done.stdout.startswith("ok: ")


def test_schema_prints_json() -> None:
    done = _gpuops("schema", "events")
    assert json.loads(done.stdout)["title"] == "gpuops event v1"
