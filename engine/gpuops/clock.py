"""Injected clocks: every stage reads time from one of these, never from `time` directly.

Cron schedules (drift checks, power windows) are APScheduler's CronTrigger, read here
against whatever clock the caller has: the slots are computed, never waited on.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Protocol

from apscheduler.triggers.cron import CronTrigger


class Clock(Protocol):
    """Seconds since the epoch, as a float."""

    def now(self) -> float: ...


class SystemClock:
    """Wall-clock time."""

    def now(self) -> float:
        return time.time()


class ManualClock:
    """A clock tests move by hand."""

    def __init__(self, start: float = 1_767_225_600.0) -> None:
        self._t = start

    def now(self) -> float:
        return self._t

    def advance(self, seconds: float) -> None:
        self._t += seconds

    def set(self, t: float) -> None:
        self._t = t


class ScaledClock:
    """Time that runs `factor` times faster than the wall, from a fixed origin.

    The demo uses it so a rule that needs a condition held for 60 s shows its
    effect in a few wall seconds without shortening the rule itself.
    """

    def __init__(self, factor: float, origin: float | None = None) -> None:
        self.factor = factor
        self._wall0 = time.monotonic()
        self._t0 = time.time() if origin is None else origin

    def now(self) -> float:
        return self._t0 + (time.monotonic() - self._wall0) * self.factor


def to_datetime(t: float) -> datetime:
    """Epoch seconds to an aware UTC datetime."""
    return datetime.fromtimestamp(t, tz=UTC)


def rfc3339(t: float) -> str:
    """Epoch seconds to RFC 3339 UTC with millisecond precision and a Z suffix."""
    return to_datetime(t).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def from_rfc3339(text: str) -> float:
    """An RFC 3339 time with its zone (`rfc3339`'s, or a `Z`) to epoch seconds."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def cron_trigger(cron: str, timezone: str, what: str) -> CronTrigger:
    """APScheduler's trigger of a crontab line in a time zone; ValueError names `what`."""
    try:
        return CronTrigger.from_crontab(cron, timezone=timezone)
    except (ValueError, KeyError) as exc:
        raise ValueError(f"{what}: bad cron {cron!r} or time zone {timezone!r}: {exc}") from exc


def latest_slot(trigger: CronTrigger, now: float, horizon_s: float) -> float | None:
    """The last slot at or before `now`, looking back at most `horizon_s`."""
    start = datetime.fromtimestamp(now - horizon_s, tz=UTC)
    end = datetime.fromtimestamp(now, tz=UTC)
    latest, fire = None, trigger.get_next_fire_time(None, start)
    while fire is not None and fire <= end:
        latest = fire
        fire = trigger.get_next_fire_time(fire, fire + timedelta(seconds=1))
    return latest.timestamp() if latest is not None else None
