"""Stage: at most N remediations per node in a window (default 5 in 7 days), then a person.

The count lives in KV, so it survives restarts and is shared by replicas.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpuops.bus.store import KV, Read, Store
from gpuops.catalog import Catalog, Effect
from gpuops.decide.history import AttemptLog, append
from gpuops.decide.stage import BaseStage, Drop, Proposal
from gpuops.match.durations import format_duration
from gpuops.models import Reason


class AttemptCap(BaseStage):
    """Drops remediations on a node that has had `cap` of them within `window_s`."""

    name = "attempt_cap"

    def __init__(
        self, kv: KV, catalog: Catalog, cap: int = 5, window_s: float = 7 * 86400.0
    ) -> None:
        self.store: Store[AttemptLog] = Store(kv, AttemptLog, "attempts")
        self.catalog = catalog
        self.cap = cap
        self.window_s = window_s

    async def attempts(self, node: str, now: float, except_event: str = "") -> int:
        """How many remediations the node had within the window."""
        log, _ = await self.store.get(node)
        return len((log or AttemptLog()).within(now, self.window_s, except_event))

    def _remediates(self, p: Proposal) -> bool:
        """Fixes and isolations count; a person's command, a return or a setting (the
        power controller's limits) do not."""
        fixing = (Effect.FIX, Effect.ISOLATE)
        return not (p.rule.by_person or p.rule.setting) and any(
            (s := self.catalog.get(a.playbook)) is not None and s.effect in fixing
            for a in p.actions
        )

    def reads(self, p: Proposal) -> Sequence[Read]:
        return (self.store.read(p.node),) if self._remediates(p) else ()

    async def check(self, p: Proposal) -> Drop | None:
        if not self._remediates(p):
            return None
        log, _ = await p.reads.get(self.store, p.node)
        done = len((log or AttemptLog()).within(p.now, self.window_s, p.event_id))
        if done < self.cap:
            return None
        return Drop(
            Reason.ATTEMPT_CAP,
            f"{done} remediations on {p.node} within "
            f"{format_duration(self.window_s)} (cap {self.cap}); a person must look at it",
        )

    async def commit(self, p: Proposal) -> None:
        if p.acts and self._remediates(p):
            known = p.reads.known(self.store, p.node)
            await append(self.store, p.node, p.now, p.event_id, self.window_s, known)
