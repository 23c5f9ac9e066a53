"""The agent against a real NVIDIA GPU, when the machine has one (scripts/gpu_check.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.skipif(
    shutil.which("nvidia-smi") is None, reason="no NVIDIA GPU here (nvidia-smi not found)"
)


def test_agent_once_on_a_real_gpu_matches_the_event_schema(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["agent_once_rc"] == 0, report["agent_once_stderr"]
    assert all(not e["schema_errors"] for e in report["events"]), report["events"]
    assert {"temp_c", "power_w", "power_limit_w", "clocks_event_reasons"} <= set(
        report["gpu_fields_present"]
    )
    assert report["probes"] and all(
        p["outcome"] in ("pass", "unavailable") for p in report["probes"]
    )
