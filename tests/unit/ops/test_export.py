"""`gpuops export`'s times and the subjects its filters read."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from gpuops.bus.wire import V2, Expander, TelemetryWriter
from gpuops.clock import ManualClock
from gpuops.errors import ConfigError
from gpuops.ops.export import Selection, _telemetry_line, parse_time


def test_times_are_durations_before_now_or_iso_times() -> None:
    clock = ManualClock(1_800_000_000.0)
    assert parse_time("2h", clock).timestamp() == 1_800_000_000.0 - 7200
    assert parse_time("1h30m", clock).timestamp() == 1_800_000_000.0 - 5400
    at = datetime(2027, 1, 15, 8, 0, tzinfo=UTC)
    assert parse_time("2027-01-15T08:00:00Z", clock) == at
    assert parse_time("2027-01-15T08:00:00", clock) == at, "no zone: UTC"
    assert parse_time("2027-01-15T09:00:00+01:00", clock) == at
    with pytest.raises(ConfigError, match="bad time 'yesterday': use a duration"):
        parse_time("yesterday", clock)


def test_filters_name_the_subjects_of_each_stream() -> None:
    assert Selection().filters() == {
        "GPUOPS_TELEMETRY": ["gpuops.telemetry.*.*"],  # stored under any partition
        "GPUOPS_EVENTS": ["gpuops.events.*.*.*"],
    }
    assert Selection(kinds=("telemetry",), nodes=("gpu.a1",)).filters() == {
        "GPUOPS_TELEMETRY": ["gpuops.telemetry.*.gpu_a1"]
    }
    assert Selection(kinds=("xid", "ecc"), nodes=("n1", "n2")).filters() == {
        "GPUOPS_EVENTS": [
            "gpuops.events.*.xid.n1",
            "gpuops.events.*.xid.n2",
            "gpuops.events.*.ecc.n1",
            "gpuops.events.*.ecc.n2",
        ]
    }


def test_a_stored_sample_nested_too_deep_is_left_out_and_the_export_goes_on() -> None:
    gpus = [{"index": 0, "uuid": "GPU-1", "temp_c": 40.0}]
    ok = TelemetryWriter("agent", json=True).encode("node-001", 1_800_000_000.0, gpus, "e1")
    deep = ok.replace(b'"gpus":[[', b'"gpus":[' + b"[" * 5000 + b"[", 1)
    deep = deep.replace(b"]]}", b"]" * 5000 + b"]]}", 1)
    expander = Expander(V2)
    facts = None  # a keyframe's sample needs no KV copy
    assert asyncio.run(_telemetry_line(expander, facts, deep, "")) is None  # type: ignore[arg-type]
    line = asyncio.run(_telemetry_line(expander, facts, ok, ""))  # type: ignore[arg-type]
    assert line is not None and b'"node":"node-001"' in line


def test_a_stored_v1_line_spanning_lines_and_nested_too_deep_is_left_out() -> None:
    """A payload that spans lines is re-encoded as one, through Python's parser."""
    deep = b'{"v": 1,\n "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for version in (1, V2):
        assert asyncio.run(_telemetry_line(Expander(version), None, deep, "")) is None  # type: ignore[arg-type]
