"""`gpuops validate --inventory` for rules keyed by the inventory, and `gpuops bench windows`."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support import gpuops_argv

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "inventories" / "example"
RACK = """rules:
  - name: rack-hot
    on: telemetry
    group_by: [{key}]
    when: max(temp_c) > 85
"""


def _gpuops(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        gpuops_argv(*args),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_validate_checks_group_keys_against_the_inventory(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.yml", tmp_path / "bad.yml"
    good.write_text(RACK.format(key="rack"))
    bad.write_text(RACK.format(key="rak"))
    done = _gpuops("validate", "--inventory", str(EXAMPLE), str(good))
    assert done.returncode == 0 and done.stdout.startswith("ok: 1 rules"), done.stdout
    done = _gpuops("validate", "--inventory", str(EXAMPLE), str(bad))
    assert done.returncode == 1
    assert done.stdout.startswith(f"{bad}:4: rule rack-hot: group_by 'rak': no host of"), (
        done.stdout
    )
    assert "did you mean rack?" in done.stdout
    done = _gpuops("validate", str(good))  # nothing to check the key against
    assert done.returncode == 1 and "pass --inventory" in done.stdout


def test_bench_windows_prints_state_per_gpu_and_rate() -> None:
    done = _gpuops("bench", "windows", "--gpus", "80", "--window", "1h")
    assert done.returncode == 0, done.stderr
    last = dict(part.split("=") for part in done.stdout.splitlines()[-1].split())
    assert set(last) == {"state_bytes_per_gpu", "rss_mb", "peak_rss_mb", "samples_per_s"}
    assert "keys=80 " in done.stdout
    assert float(last["samples_per_s"]) > 0
