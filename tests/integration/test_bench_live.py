"""The engine `gpuops bench instructions --live` counts: it reads every sample it was
given from a real nats-server, each proved by its node's MAC, and stops once it has (a
count of fewer would make live look cheaper than it is); one it cannot read stops it
with the count, rather than a figure."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from gpuops.bench import live_instructions as live
from gpuops.bench.replay import T0, record
from gpuops.bench.rulebook import samples
from gpuops.bus.server import EmbeddedNats

pytestmark = pytest.mark.integration


def _spec(tmp_path: Path, server: EmbeddedNats, inventory: Path, lines: int) -> dict[str, object]:
    work = tmp_path / "engine"
    work.mkdir()
    return {
        "inventory": str(inventory),
        "partitions": 2,
        "batch": 6,
        "clock": T0 + 10,
        "lines": lines,
        "url": server.url,
        "work": str(work),
        "stuck_s": 5.0,
    }


def _engine(spec: dict[str, object]) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-c", live._LIVE, json.dumps(spec)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=180)


def _recording(tmp_path: Path) -> tuple[list[bytes], Path]:
    recording, inventory, n = record(tmp_path, 4 * 8 * 10, 10, live.STEP_S)
    v2 = tmp_path / "v2.jsonl"
    assert samples(recording, v2) == n == 4 * 8 * 10
    return v2.read_bytes().splitlines(), inventory


def test_the_live_bench_engine_reads_every_signed_sample_and_says_when(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    lines, inventory = _recording(tmp_path)
    spec = _spec(tmp_path, nats_server, inventory, len(lines))
    asyncio.run(live._publish(spec, lines))

    done = _engine(spec)

    assert done.returncode == 0, done.stderr[-3000:]
    assert live._drained(done.stdout.encode()) > 0


def test_a_sample_the_engine_refuses_stops_the_bench_with_its_count(
    tmp_path: Path, nats_server: EmbeddedNats
) -> None:
    lines, inventory = _recording(tmp_path)
    spec = _spec(tmp_path, nats_server, inventory, len(lines) + 1)
    # One line more than the engine can handle: a sample (not a keyframe) of a node whose
    # static facts it never saw is a dead letter (facts_unknown).
    assert b'"static"' not in lines[-1]
    stranger = lines[-1].replace(b'"node":"node-', b'"node":"zzzz-')
    assert stranger != lines[-1]
    asyncio.run(live._publish(spec, [*lines, stranger]))

    done = _engine(spec)

    assert done.returncode != 0
    assert f"handled {len(lines)} of {len(lines) + 1} telemetry events" in done.stderr, done.stderr
