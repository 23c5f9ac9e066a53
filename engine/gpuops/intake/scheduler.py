"""Scheduled drift checks, run by the engine itself.

Cron expressions and time zones are APScheduler's CronTrigger; the slots are driven
here on the injected clock so that:
- a slot runs once even with two engine replicas: it is claimed in KV with
  compare-and-set before it runs;
- it does not run twice after a restart: the last claimed slot is in KV;
- a slot missed while the engine was down runs once on start if it is still within
  the grace period, and is recorded as missed otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from apscheduler.triggers.cron import CronTrigger
from pydantic import BaseModel, ConfigDict

from gpuops.bus.store import KV, Store
from gpuops.clock import Clock, cron_trigger, latest_slot
from gpuops.errors import ConfigError
from gpuops.settings import DriftSchedule

log = logging.getLogger(__name__)

Runner = Callable[[str], Awaitable[object]]
Recorder = Callable[[str, dict[str, object]], Awaitable[None]]


def trigger_for(schedule: DriftSchedule) -> CronTrigger:
    """The cron trigger of a schedule; ConfigError names a bad expression or zone."""
    try:
        return cron_trigger(schedule.cron, schedule.timezone, f"drift schedule {schedule.name}")
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


class SlotClaim(BaseModel):
    """Who took a schedule's latest slot, and how it went (shared by replicas in KV)."""

    model_config = ConfigDict(frozen=True)

    slot: float
    state: str  # before-first-start | missed | running | done
    by: str
    started: float | None = None
    ended: float | None = None


@dataclass
class Slot:
    """One schedule's slot, and what became of it."""

    schedule: str
    at: float
    outcome: str  # ran | missed | claimed-elsewhere


class DriftScheduler:
    """Checks every tick whether a schedule's slot is due and, if this replica wins it, runs it."""

    def __init__(
        self,
        schedules: tuple[DriftSchedule, ...],
        kv: KV,
        clock: Clock,
        run: Runner,
        record: Recorder,
        grace_s: float,
        replica: str = "engine",
    ) -> None:
        self.items = [(s, trigger_for(s)) for s in schedules]
        self.claims: Store[SlotClaim] = Store(kv, SlotClaim, "drift.slot")
        self.clock, self.run_check, self.record = clock, run, record
        self.grace_s = grace_s
        self.replica = replica

    async def tick(self) -> list[Slot]:
        """Run what is due now; returns what happened to each slot considered."""
        out = []
        for schedule, trigger in self.items:
            slot = await self._consider(schedule, trigger)
            if slot is not None:
                out.append(slot)
        return out

    async def _consider(self, schedule: DriftSchedule, trigger: CronTrigger) -> Slot | None:
        now = self.clock.now()
        name = schedule.name
        claimed, rev = await self.claims.get(name)
        last = claimed.slot if claimed else float("-inf")
        # Look back far enough to notice a slot missed beyond the grace period.
        due = latest_slot(trigger, now, max(self.grace_s, 1.0) + 86400.0 * 7)
        if due is None or due <= last:
            return None
        if now - due > self.grace_s and claimed is None:
            # A schedule seen for the first time: slots before it existed were never missed.
            await self.claims.put(
                SlotClaim(slot=due, state="before-first-start", by=self.replica), name
            )
            return None
        if now - due > self.grace_s:
            await self.claims.put(SlotClaim(slot=due, state="missed", by=self.replica), name)
            await self.record(
                f"drift check {schedule.name}: slot missed beyond the grace period",
                {"schedule": schedule.name, "slot": due, "outcome": "missed"},
            )
            return Slot(schedule.name, due, "missed")
        mine = SlotClaim(slot=due, state="running", by=self.replica, started=now)
        if not await self.claims.cas(mine, rev, name):
            return Slot(schedule.name, due, "claimed-elsewhere")
        log.info("drift check %s for slot %s over %s", schedule.name, due, schedule.group)
        await self.run_check(schedule.group)
        done = mine.model_copy(update={"state": "done", "ended": self.clock.now()})
        await self.claims.put(done, name)
        return Slot(schedule.name, due, "ran")

    async def run(self, stop: asyncio.Event, every_s: float = 15.0) -> None:
        """Tick until `stop`; a failed check is logged and the next slot still runs."""
        while not stop.is_set():
            try:
                await self.tick()
            except Exception:
                log.exception("drift scheduler tick failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
