"""Stored records that do not decode: told once, counted, shown until repaired.

A value in a KV bucket that is not what it should be (garbage written by hand, a
half-done migration, a bug) is never read as "absent" (gpuops.errors.StateUnreadable):
whatever reads it fails closed. This keeps the list of those met, so a person hears of
each one once (a log line and a metric), sees it in `gpuops status` and the console,
and repairs it (`gpuops state repair BUCKET KEY`). An entry goes when its record reads
again (repaired, or written anew) or is gone: `recheck` looks, once a heartbeat.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

from gpuops.bus.store import KV
from gpuops.clock import Clock, SystemClock
from gpuops.errors import StateUnreadable
from gpuops.record.metrics import Metrics

log = logging.getLogger(__name__)

# The record type a (bucket, key) holds; None for a key no store reads.
ModelOf = Callable[[str, str], "type[BaseModel] | None"]

# Entries listed in a status or heartbeat; the count says how many more there are.
SHOWN = 20
# Distinct records remembered; past this, more are still dropped and counted, not kept.
KEPT = 1000


@dataclass(frozen=True, slots=True)
class Unreadable:
    """One record that does not decode, as first met."""

    bucket: str
    key: str
    detail: str
    since: float

    def line(self) -> str:
        """How a status shows it, with what to do."""
        return (
            f"{self.bucket}/{self.key}: unreadable ({self.detail}); nothing acts on what it "
            f"guards: gpuops state repair {self.bucket} {self.key}"
        )


class UnreadableState:
    """The unreadable records this process met."""

    def __init__(self, metrics: Metrics | None = None, clock: Clock | None = None) -> None:
        self.metrics = metrics
        self.clock = clock or SystemClock()
        self._found: dict[tuple[str, str], Unreadable] = {}

    def note(self, exc: StateUnreadable) -> Unreadable:
        """Remember `exc`'s record; the first time, log it and count it."""
        slot = (exc.bucket, exc.key)
        known = self._found.get(slot)
        if known is not None:
            return known
        found = Unreadable(exc.bucket, exc.key, exc.detail, self.clock.now())
        log.error("state %s", found.line())
        if self.metrics is not None:
            self.metrics.state_unreadable.labels(exc.bucket).inc()
        if len(self._found) < KEPT:
            self._found[slot] = found
            self._gauge(exc.bucket)
        return found

    def cleared(self, bucket: str, key: str) -> None:
        """A record read again, repaired or gone."""
        if self._found.pop((bucket, key), None) is not None:
            log.info("state %s/%s readable again", bucket, key)
            self._gauge(bucket)

    def entries(self) -> list[Unreadable]:
        """Every record unreadable now, oldest first."""
        return sorted(self._found.values(), key=lambda u: (u.since, u.bucket, u.key))

    async def recheck(self, buckets: Mapping[str, KV], model_of: ModelOf) -> None:
        """Drop the entries whose records decode now or are gone (a person repaired one
        through another replica, or the engine wrote it anew)."""
        for u in self.entries():
            kv = buckets.get(u.bucket)
            if kv is None:
                continue
            entry = await kv.get(u.key)
            if entry is None or _decodes(model_of(u.bucket, u.key), entry.value):
                self.cleared(u.bucket, u.key)

    def _gauge(self, bucket: str) -> None:
        if self.metrics is not None:
            now = sum(1 for b, _ in self._found if b == bucket)
            self.metrics.state_unreadable_now.labels(bucket).set(now)


def _decodes(model: type[BaseModel] | None, value: bytes) -> bool:
    if model is None:
        return False  # no longer a record anyone reads: a person clears it
    try:
        model.model_validate_json(value)
    except ValidationError:
        return False
    return True
