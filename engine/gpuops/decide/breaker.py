"""Stage: the fleet breaker. When more nodes lost capacity within a window than a share
of the fleet or an absolute number allow, automated remediation that takes capacity
away stops: the breaker opens, people are told, and it stays open until a person resets
it. Half-open lets one such action through, on approval; that approval closes it.

What counts is the playbook catalogue's `breaker: true` (drain, reset, reboot,
reprovision). State in the control bucket under `breaker`, changed with compare-and-set.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from gpuops.bus.store import CAS_TRIES, KV, Read, Store, contended
from gpuops.catalog import Catalog
from gpuops.decide.stage import BaseStage, Drop, Proposal
from gpuops.errors import BusError, StateUnreadable
from gpuops.match.durations import format_duration
from gpuops.models import Reason
from gpuops.record.unreadable import UnreadableState


class BreakerState(StrEnum):
    """Closed lets actions through; open stops them; half-open lets one through on approval."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Entry(BaseModel):
    """A node that lost capacity, and when."""

    model_config = ConfigDict(frozen=True)

    node: str
    at: float
    event_id: str = ""  # the decision that counted it (an abort takes back only its own)


class BreakerRecord(BaseModel):
    """The breaker's state and the recent entries it counts."""

    model_config = ConfigDict(frozen=True)

    state: BreakerState = BreakerState.CLOSED
    why: str = ""
    since: float = 0.0
    by: str = ""
    entries: tuple[Entry, ...] = ()

    def recent(self, now: float, window: float) -> set[str]:
        """Nodes counted within the window."""
        return {e.node for e in self.entries if now - e.at <= window}


FLEET = "fleet"  # the breaker's one record


def limit_for(fleet_size: int, share: float, absolute: int, floor: int = 2) -> int:
    """How many nodes may lose capacity within the window: the fleet's share (rounded up),
    at most `absolute`; at least `floor` so a small fleet is not stopped by its second
    fault (5% of 11 nodes is one), though never more than half the fleet; at least one."""
    small = min(floor, fleet_size // 2)
    return max(1, small, min(math.ceil(fleet_size * share), absolute))


class BreakerStore:
    """Reads and changes the breaker's state."""

    def __init__(self, kv: KV) -> None:
        self.store: Store[BreakerRecord] = Store(kv, BreakerRecord, "breaker")

    async def get(self) -> tuple[BreakerRecord, int]:
        """The state and its revision (closed and empty when never written)."""
        value, rev = await self.store.get(FLEET)
        return value or BreakerRecord(), rev

    async def shown(self, unreadable: UnreadableState) -> tuple[BreakerRecord, bool]:
        """The state as people and metrics see it, and whether its record is unreadable:
        one that does not decode reads as open (the stage stops what counts for it)."""
        try:
            return (await self.get())[0], False
        except StateUnreadable as exc:
            unreadable.note(exc)
            why = f"its record is unreadable ({exc.detail}): automation that counts stops"
            return BreakerRecord(state=BreakerState.OPEN, why=why), True

    async def set_state(self, state: BreakerState, why: str, at: float, by: str = "") -> None:
        """A person resets (closed), half-opens, or the engine trips (open) the breaker."""

        def change(current: BreakerRecord | None) -> BreakerRecord:
            entries = () if state is BreakerState.CLOSED else (current or BreakerRecord()).entries
            return BreakerRecord(state=state, why=why, since=at, by=by, entries=entries)

        await self.store.update(change, FLEET)


class FleetBreaker(BaseStage):
    """Counts distinct nodes losing capacity; trips past the limit."""

    name = "breaker"

    def __init__(
        self,
        store: BreakerStore,
        catalog: Catalog,
        fleet_size: int,
        *,
        share: float = 0.05,
        absolute: int = 20,
        floor: int = 2,
        window_s: float = 600.0,
        on_trip: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.store = store
        self.catalog = catalog
        self.limit = limit_for(fleet_size, share, absolute, floor)
        self.window_s = window_s
        self.on_trip = on_trip

    def _counts(self, p: Proposal) -> bool:
        return p.acts and self.catalog.counts_for_breaker(a.playbook for a in p.actions)

    def reads(self, p: Proposal) -> Sequence[Read]:
        return (self.store.store.read(FLEET),) if self._counts(p) else ()

    async def check(self, p: Proposal) -> Drop | None:
        """Count the node in as it passes, with compare-and-set: deciders working at once
        (partitions, replicas) each see the others' nodes, so together they never let more
        through than the limit. A later stage's drop takes the entry back (`abort`)."""
        if not self._counts(p):
            return None
        found, rev = await p.reads.get(self.store.store, FLEET)  # read ahead, with the rest
        state = found or BreakerRecord()
        for lost in range(CAS_TRIES):
            if state.state is BreakerState.OPEN:
                return Drop(
                    Reason.BREAKER_OPEN, f"fleet breaker open ({state.why}); a person resets it"
                )
            if state.state is BreakerState.HALF_OPEN:
                p.approval = True
                p.closes_breaker = True
                p.notes.append("breaker half-open: this one action needs approval and closes it")
                return None
            recent = state.recent(p.now, self.window_s)
            if p.node in recent:
                return None
            if len(recent) + 1 > self.limit:
                return await self._trip(state, rev, len(recent) + 1, p)
            if await p.reads.cas(self.store.store, self._entered(state, p), rev, FLEET):
                return None
            await contended(lost)  # another decision changed it first: count again
            state, rev = await self.store.get()
        raise BusError("fleet breaker: too many concurrent changes; the event is decided again")

    async def _trip(self, state: BreakerRecord, rev: int, count: int, p: Proposal) -> Drop:
        why = (
            f"{count} nodes would lose capacity within "
            f"{format_duration(self.window_s)} (limit {self.limit})"
        )
        opened = BreakerRecord(
            state=BreakerState.OPEN, why=why, since=p.now, by="engine", entries=state.entries
        )
        if await self.store.store.cas(opened, rev, FLEET) and self.on_trip is not None:
            await self.on_trip(why)
        return Drop(Reason.BREAKER_OPEN, f"tripped: {why}")

    def _entered(self, state: BreakerRecord, p: Proposal) -> BreakerRecord:
        kept = tuple(e for e in state.entries if p.now - e.at <= self.window_s)
        entry = Entry(node=p.node, at=p.now, event_id=p.event_id)
        return state.model_copy(update={"entries": (*kept, entry)})

    async def abort(self, p: Proposal) -> None:
        if not self._counts(p) or p.closes_breaker:
            return

        def leave(state: BreakerRecord | None) -> BreakerRecord | None:
            if state is None:
                return None
            kept = tuple(
                e for e in state.entries if not (e.node == p.node and e.event_id == p.event_id)
            )
            return None if kept == state.entries else state.model_copy(update={"entries": kept})

        await self.store.store.update(leave, FLEET, known=p.reads.known(self.store.store, FLEET))

    async def commit(self, p: Proposal) -> None:
        if not self._counts(p):
            return
        if p.closes_breaker:
            await self.store.set_state(
                BreakerState.CLOSED, f"half-open action approved by {p.approved_by}", p.now
            )
            return

        def enter(state: BreakerRecord | None) -> BreakerRecord | None:
            current = state or BreakerRecord()
            if p.node in current.recent(p.now, self.window_s):
                return None  # counted at check (or by an earlier decision on it)
            return self._entered(current, p)

        known = p.reads.known(self.store.store, FLEET)
        await self.store.store.update(enter, FLEET, known=known)
