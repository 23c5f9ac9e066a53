"""Stage: events older than the cutoff are recorded, never acted upon."""

from __future__ import annotations

from engine.decide.stage import BaseStage, Drop, Proposal
from engine.match.durations import format_duration
from engine.models import Reason


class StaleCutoff(BaseStage):
    """After a restart or an outage, old events must not turn into actions."""

    name = "stale"

    def __init__(self, max_age_s: float) -> None:
        self.max_age_s = max_age_s

    async def check(self, p: Proposal) -> Drop | None:
        age = p.now - p.match.event_ts
        if age <= self.max_age_s:
            return None
        return Drop(Reason.STALE, f"event is {format_duration(age)} old")
