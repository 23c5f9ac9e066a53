"""`gpuops bench decide`: a decision's round trips and latency on a real nats-server."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support import gpuops_argv

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]


def test_bench_decide_prints_round_trips_and_latencies() -> None:
    done = subprocess.run(
        gpuops_argv("bench", "decide", "--nodes", "20"),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    last = dict(part.split("=") for part in done.stdout.splitlines()[-1].split())
    assert set(last) == {
        "critical_path",
        "accepted_p50_ms",
        "accepted_p99_ms",
        "dropped_p50_ms",
        "dropped_p99_ms",
        "unexpected",
    }
    assert last["unexpected"] == "0", done.stdout  # each accepted, then dropped by cooldown
    # Reads, lock, breaker count, intents, then the commits alongside the record (which
    # reads first): 7, 8 when the commits answered before the record's first read went
    # out (was 23, one after another).
    assert int(last["critical_path"]) <= 8, done.stdout
    assert float(last["dropped_p50_ms"]) > 0 and float(last["accepted_p50_ms"]) > 0
