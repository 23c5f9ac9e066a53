"""The matcher on real H200 recordings and on faults."""

from __future__ import annotations

import json
from pathlib import Path

from gpuops.clock import ManualClock
from gpuops.match.loader import load_rules
from gpuops.match.matcher import Matcher
from gpuops.models import EVENT_ADAPTER

ROOT = Path(__file__).resolve().parents[3]
TRACE = ROOT / "tests" / "fixtures" / "nvml" / "h200_trace_load_burst.jsonl"
SNAPSHOT = json.loads((ROOT / "tests" / "fixtures" / "nvml" / "h200_snapshot.json").read_text())


def _telemetry(t0: float, rec: dict, **over: object) -> object:
    dev = SNAPSHOT["devices"][0]
    gpu = {
        "index": 0,
        "uuid": dev["uuid"],
        "temp_c": rec["temp_c"],
        "mem_temp_c": rec["mem_temp_c"],
        "temp_slowdown_c": dev["temp_thresholds"]["gpu_slowdown"],
        "temp_shutdown_c": dev["temp_thresholds"]["gpu_shutdown"],
        "temp_gpu_max_c": dev["temp_thresholds"]["gpu_max"],
        "temp_mem_max_c": dev["temp_thresholds"]["mem_max"],
        "power_w": rec["power_mw"] / 1000,
        "power_limit_w": dev["power_limit_mw"] / 1000,
        "power_default_limit_w": dev["power_limit_default_mw"] / 1000,
        "sm_clock_mhz": rec["sm_mhz"],
        "util_gpu": rec["util"]["gpu"],
        "util_mem": rec["util"]["memory"],
        "mem_used_bytes": rec["mem"]["used"],
        "mem_total_bytes": rec["mem"]["total"],
        "clocks_event_reasons": rec["clocks_event_reasons"],
        "ecc_sbe_volatile": 0,
        "ecc_dbe_volatile": 0,
        "pcie_gen": 5,
        "pcie_width": 16,
        **over,
    }
    from gpuops.clock import rfc3339

    return EVENT_ADAPTER.validate_python(
        {
            "id": f"t{rec['t']}",
            "kind": "telemetry",
            "node": "h200",
            "ts": rfc3339(t0 + rec["t"]),
            "source": "recording",
            "data": {"gpus": [gpu]},
        }
    )


def test_real_h200_load_burst_triggers_nothing() -> None:
    # Power at the full 700 W cap with reason 0x4 under a legitimate burst is not a fault.
    matcher = Matcher(load_rules([ROOT / "rules"], ROOT / "playbooks"))
    records = [json.loads(line) for line in TRACE.read_text().splitlines()]
    assert any(r["clocks_event_reasons"] & 0x4 for r in records), "the trace has power capping"
    matches = []
    for loop in range(10):  # ~250 s of the recording, back to back
        for rec in records:
            matches += matcher.match(_telemetry(1_800_000_000.0 + loop * 25.0, rec))
    assert matches == []


def test_sustained_heat_fires_after_the_for_duration() -> None:
    matcher = Matcher(load_rules([ROOT / "rules"], ROOT / "playbooks"))
    rec = json.loads(TRACE.read_text().splitlines()[0])
    fired = []
    for second in range(0, 70, 5):
        hot = _telemetry(1_800_000_000.0 + second, {**rec, "t": 0}, temp_c=88)
        fired.append((second, [m.rule for m in matcher.match(hot)]))
    first = next(s for s, rules in fired if "gpu-overheat" in rules)
    assert first == 60


def test_sweeping_during_a_backlog_keeps_each_keys_windows() -> None:
    # After an outage the engine reads a backlog of samples minutes old while its clock is
    # now: eviction of quiet keys must not sweep a minute of old heat away mid-run.
    start = 1_800_000_000.0
    clock = ManualClock(start + 300.0)  # five minutes behind
    matcher = Matcher(load_rules([ROOT / "rules"], ROOT / "playbooks"), clock)
    rec = json.loads(TRACE.read_text().splitlines()[0])
    fired = []
    for second in range(0, 70, 5):
        fired += [
            m.rule for m in matcher.match(_telemetry(start + second, {**rec, "t": 0}, temp_c=88))
        ]
        matcher.sweep()  # what the engine's tick does, at any moment
    assert "gpu-overheat" in fired
    clock.advance(10_000)
    matcher.sweep()
    assert matcher.state_size() == 1  # the day-long utilisation window (density) stays
    clock.advance(2 * 86400)
    matcher.sweep()  # keys quiet for longer than every window (and the grace) are evicted
    assert matcher.state_size() == 0


def test_one_keys_future_event_moves_no_other_keys_windows() -> None:
    start = 1_800_000_000.0
    clock = ManualClock(start)
    matcher = Matcher(load_rules([ROOT / "rules"], ROOT / "playbooks"), clock)
    rec = json.loads(TRACE.read_text().splitlines()[0])
    far = _telemetry(start + 365 * 86400.0, {**rec, "t": 0}, temp_c=88)
    matcher.match(far.model_copy(update={"node": "ghost"}))
    fired = []
    for second in range(0, 70, 5):
        clock.set(start + second)
        fired += [
            m.rule for m in matcher.match(_telemetry(start + second, {**rec, "t": 0}, temp_c=88))
        ]
        matcher.sweep()
    assert "gpu-overheat" in fired
