"""Stage: the fleet breaker. When more nodes entered quarantine within a window than a
share of the fleet or an absolute number allow, automated quarantine stops: the breaker
opens, people are told, and it stays open until a person resets it. Half-open lets one
quarantine through, on approval; that approval closes it.

State in the control bucket under `breaker`, changed with compare-and-set.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

from nats.js.kv import KeyValue

from engine.bus.kvjson import cas_json, get_json, put_json
from engine.decide.stage import BaseStage, Drop, Proposal
from engine.effects import quarantines
from engine.match.durations import format_duration
from engine.models import Reason

KEY = "breaker"
CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


def limit_for(fleet_size: int, share: float, absolute: int) -> int:
    """How many nodes may enter quarantine within the window."""
    return max(1, min(math.ceil(fleet_size * share), absolute))


class BreakerStore:
    """Reads and changes the breaker's state."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def get(self) -> tuple[dict[str, Any], int]:
        """The state and its revision (closed and empty when never written)."""
        value, rev = await get_json(self.kv, KEY)
        return value or {"state": CLOSED, "entries": []}, rev

    async def set_state(self, state: str, why: str, at: float, by: str = "") -> None:
        """A person resets (closed), half-opens, or the engine trips (open) the breaker."""
        current, _ = await self.get()
        entries = [] if state == CLOSED else current.get("entries", [])
        await put_json(
            self.kv, KEY, {"state": state, "why": why, "since": at, "by": by, "entries": entries}
        )


class FleetBreaker(BaseStage):
    """Counts distinct nodes entering quarantine; trips past the limit."""

    name = "breaker"

    def __init__(
        self,
        store: BreakerStore,
        fleet_size: int,
        *,
        share: float = 0.05,
        absolute: int = 20,
        window_s: float = 600.0,
        on_trip: Callable[[str], Awaitable[None]] | None = None,
    ) -> None:
        self.store = store
        self.limit = limit_for(fleet_size, share, absolute)
        self.window_s = window_s
        self.on_trip = on_trip

    async def check(self, p: Proposal) -> Drop | None:
        if not quarantines([a.playbook for a in p.actions]) or p.dry_run:
            return None
        state, rev = await self.store.get()
        if state["state"] == OPEN:
            return Drop(
                Reason.BREAKER_OPEN,
                f"fleet breaker open since {state.get('why', '')}; a person resets it",
            )
        if state["state"] == HALF_OPEN:
            p.approval = True
            p.notes.append("breaker half-open: this one action needs approval and closes it")
            return None
        recent = {n for n, t in state.get("entries", []) if p.now - t <= self.window_s}
        if p.node in recent or len(recent) + 1 <= self.limit:
            return None
        why = (
            f"{len(recent) + 1} nodes would be in quarantine within "
            f"{format_duration(self.window_s)} (limit {self.limit})"
        )
        opened = {
            "state": OPEN,
            "why": why,
            "since": p.now,
            "by": "engine",
            "entries": state.get("entries", []),
        }
        if await cas_json(self.store.kv, KEY, opened, rev) and self.on_trip is not None:
            await self.on_trip(why)
        return Drop(Reason.BREAKER_OPEN, f"tripped: {why}")

    async def commit(self, p: Proposal) -> None:
        if not quarantines([a.playbook for a in p.actions]) or p.dry_run or p.approval:
            return
        for _ in range(5):  # a replica may have written meanwhile: re-read and retry
            state, rev = await self.store.get()
            entries = [[n, t] for n, t in state.get("entries", []) if p.now - t <= self.window_s]
            entries.append([p.node, p.now])
            if await cas_json(self.store.kv, KEY, {**state, "entries": entries}, rev):
                return
