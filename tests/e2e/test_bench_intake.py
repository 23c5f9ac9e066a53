"""`gpuops bench intake`: engine CPU per sample and XID -> intent latency, on a real
nats-server with a paced publisher."""

from __future__ import annotations

import gc
import re
import subprocess
from pathlib import Path

import pytest
from gpuops.bench.intake import GcPauses

from tests.support import gpuops_argv

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--gpus", "160", "--seconds", "3", "--health", "6"]


@pytest.mark.slow  # a bench run of its own: `make test-slow`
def test_bench_intake_reports_every_health_event_and_the_collectors_pauses() -> None:
    done = subprocess.run(
        gpuops_argv("bench", "intake", *SMALL),
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "xid -> intent: 6/6 intents" in out, out
    handled = re.search(r"handled: ([\d,]+) GPU samples/s", out)
    assert handled and int(handled.group(1).replace(",", "")) > 0, out
    # Pulls counted by the intakes' histogram: samples came, so some pull brought some.
    pulls = re.search(r"([\d.]+) messages a pull \(([\d,]+) pulls\)", out)
    assert pulls and float(pulls.group(1)) >= 1 and int(pulls.group(2).replace(",", "")) > 0, out
    assert re.search(r"garbage collector: gen0 \d+ x .*; [\d,]+ objects tracked", out), out
    parts = re.search(
        r"replay ([\d.]+) us a sample \(of it decoding ([\d.]+), observers ([\d.]+), "
        r"matcher ([\d.]+)\); live [\d.]+ us",
        out,
    )
    assert parts, out
    replay, *each = (float(v) for v in parts.groups())
    assert all(v > 0 for v in each) and sum(each) < replay * 1.5, out  # parts of one whole


def test_gc_pauses_counts_each_generations_collections() -> None:
    before = list(gc.callbacks)
    with GcPauses() as pauses:
        gc.collect(2)
        gc.collect(0)
    got = pauses.summary()
    assert got["2"]["n"] == 1 and got["0"]["n"] == 1, got
    assert got["2"]["max_ms"] > 0, got
    assert gc.callbacks == before  # its hook is removed again
