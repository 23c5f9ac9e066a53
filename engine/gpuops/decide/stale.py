"""Stage: events older than the cutoff, or dated ahead of the engine's clock, are
recorded, never acted upon (intake dead-letters the far future; this is the backstop)."""

from __future__ import annotations

from gpuops.decide.stage import BaseStage, Drop, Proposal
from gpuops.match.durations import format_duration
from gpuops.models import Reason


class StaleCutoff(BaseStage):
    """After a restart or an outage, old events must not turn into actions."""

    name = "stale"

    def __init__(self, max_age_s: float, max_future_s: float = 300.0) -> None:
        self.max_age_s = max_age_s
        self.max_future_s = max_future_s

    async def check(self, p: Proposal) -> Drop | None:
        if p.approved_by is not None:
            return None  # a person looked at it and said yes, however long that took
        age = p.now - p.match.event_ts
        if age < -self.max_future_s:
            return Drop(Reason.STALE, f"event is dated {format_duration(-age)} in the future")
        if age <= self.max_age_s:
            return None
        return Drop(Reason.STALE, f"event is {format_duration(age)} old")
