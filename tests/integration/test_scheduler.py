"""Scheduled drift checks on an injected clock: on time, once, across replicas and restarts."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from gpuops.bus.conn import Bus
from gpuops.bus.store import NatsKV
from gpuops.clock import ManualClock, latest_slot
from gpuops.intake.scheduler import DriftScheduler, trigger_for
from gpuops.settings import DriftSchedule

pytestmark = pytest.mark.integration
NIGHTLY = DriftSchedule(name="nightly", cron="0 3 * * *", timezone="Europe/Berlin", group="h200")


def _at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def _scheduler(
    bus: Bus,
    clock: ManualClock,
    runs: list[str],
    notes: list[str],
    replica: str = "a",
    grace_s: float = 3600.0,
) -> DriftScheduler:
    async def run(group: str) -> None:
        runs.append(f"{replica}:{group}")

    async def record(summary: str, body: dict[str, object]) -> None:
        notes.append(summary)

    control = NatsKV(bus.kv["control"])
    return DriftScheduler((NIGHTLY,), control, clock, run, record, grace_s, replica)


def test_slots_follow_the_time_zone() -> None:
    trigger = trigger_for(NIGHTLY)
    # 03:00 in Berlin is 02:00 UTC in winter.
    assert latest_slot(trigger, _at("2026-11-30T02:00:30"), 3600) == _at("2026-11-30T02:00:00")
    assert latest_slot(trigger, _at("2026-11-30T01:59:59"), 3600) is None


async def test_slot_fires_on_time_once(bus: Bus) -> None:
    clock, runs, notes = ManualClock(_at("2026-11-30T01:59:00")), [], []
    sched = _scheduler(bus, clock, runs, notes)
    assert await sched.tick() == []
    clock.set(_at("2026-11-30T02:00:05"))
    assert [s.outcome for s in await sched.tick()] == ["ran"]
    clock.advance(60)
    assert await sched.tick() == []
    assert runs == ["a:h200"]


async def test_two_replicas_run_a_slot_once(bus: Bus) -> None:
    clock, runs, notes = ManualClock(_at("2026-11-30T02:00:01")), [], []
    a = _scheduler(bus, clock, runs, notes, "a")
    b = _scheduler(bus, clock, runs, notes, "b")
    outcomes = [s.outcome for s in await a.tick()] + [s.outcome for s in await b.tick()]
    assert outcomes == ["ran"] and runs == ["a:h200"]


async def test_restart_does_not_run_a_slot_twice(bus: Bus) -> None:
    clock, runs, notes = ManualClock(_at("2026-11-30T02:00:01")), [], []
    await _scheduler(bus, clock, runs, notes).tick()
    clock.advance(120)
    assert await _scheduler(bus, clock, runs, notes).tick() == []  # a new process, same KV
    assert runs == ["a:h200"]


async def test_missed_slot_runs_once_within_grace_and_is_recorded_beyond(bus: Bus) -> None:
    clock, runs, notes = (
        ManualClock(_at("2026-11-30T02:40:00")),
        [],
        [],
    )  # down at 02:00, up at 02:40
    assert [s.outcome for s in await _scheduler(bus, clock, runs, notes).tick()] == ["ran"]
    clock.set(_at("2026-12-01T05:00:00"))  # down over the next slot, 3 h late: beyond 1 h grace
    assert [s.outcome for s in await _scheduler(bus, clock, runs, notes).tick()] == ["missed"]
    assert runs == ["a:h200"] and notes == [
        "drift check nightly: slot missed beyond the grace period"
    ]
