"""`gpuops bench replay`: replay's CPU per GPU sample with 1 and N rules, and decoding's."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.support import gpuops_argv

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_bench_replay_prints_samples_per_cpu_second_for_each_rule_count() -> None:
    done = subprocess.run(
        gpuops_argv("bench", "replay", "--gpus", "800", "--rules", "5", "--repeat", "1"),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert re.match(r"recording: 800 GPU samples in 100 telemetry events", lines[0]), lines
    for n, line in zip((1, 5), lines[1:3], strict=True):
        found = re.match(rf"replay, {n} rules?: ([\d,]+) GPU samples per CPU-second", line)
        assert found and int(found.group(1).replace(",", "")) > 0, line
    assert re.match(r"decoding alone .*: [\d.]+ us a GPU sample", lines[3]), lines
