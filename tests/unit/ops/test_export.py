"""`gpuops export`'s times and the subjects its filters read."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from gpuops.clock import ManualClock
from gpuops.errors import ConfigError
from gpuops.ops.export import Selection, parse_time


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
