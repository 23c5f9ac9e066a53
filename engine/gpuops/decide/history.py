"""Remediation history per node, shared by the ladder and the attempt cap.

A log is a list of (time, event id); appending is idempotent by event id, so a decision
replayed after a crash is not counted twice.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from gpuops.bus.store import Store


class Attempt(BaseModel):
    """One remediation decided for a node."""

    model_config = ConfigDict(frozen=True)

    at: float
    event_id: str = ""


class AttemptLog(BaseModel):
    """Remediations within a window, oldest first."""

    model_config = ConfigDict(frozen=True)

    attempts: tuple[Attempt, ...] = ()

    def within(self, now: float, window: float, except_event: str = "") -> list[Attempt]:
        """Attempts no older than `window`, leaving out the one for `except_event`."""
        return [a for a in self.attempts if now - a.at <= window and a.event_id != except_event]


async def append(
    store: Store[AttemptLog],
    key: str,
    at: float,
    event_id: str,
    window: float,
    known: tuple[AttemptLog | None, int] | None = None,
) -> None:
    """Add an attempt (once per event), forgetting those older than `window`; `known`:
    the log and revision a check just read (Store.update)."""

    def add(log: AttemptLog | None) -> AttemptLog | None:
        kept = (log or AttemptLog()).within(at, window)
        if any(a.event_id == event_id for a in kept):
            return None
        return AttemptLog(attempts=(*kept, Attempt(at=at, event_id=event_id)))

    await store.update(add, key, known=known)
