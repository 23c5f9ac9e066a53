"""Stage: a reboot (or reprovision) in progress or done recently supersedes a GPU reset.

Accepted actions are remembered per node with their weight from the playbook
catalogue; a lighter action on a node that a heavier one just covered is dropped as
superseded (the heavier one resets every GPU anyway).
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from gpuops.bus.store import KV, Read, Store
from gpuops.catalog import NODE_WIDE, Catalog
from gpuops.decide.stage import BaseStage, Drop, Proposal
from gpuops.match.durations import format_duration
from gpuops.models import Reason


class Heavy(BaseModel):
    """The heaviest action recently decided for a node."""

    model_config = ConfigDict(frozen=True)

    at: float
    playbook: str
    event_id: str = ""


class Equivalence(BaseStage):
    """Drops a lighter remediation when a heavier one ran on the node within `window_s`."""

    name = "equivalence"

    def __init__(self, kv: KV, catalog: Catalog, window_s: float = 1800.0) -> None:
        self.store: Store[Heavy] = Store(kv, Heavy, "heavy")
        self.catalog = catalog
        self.window_s = window_s

    def _weight(self, p: Proposal) -> int:
        return max((self.catalog.weight(a.playbook) for a in p.actions), default=0)

    def reads(self, p: Proposal) -> Sequence[Read]:
        return (self.store.read(p.node),) if self._weight(p) else ()

    async def check(self, p: Proposal) -> Drop | None:
        weight = self._weight(p)
        if weight == 0:
            return None
        recent, _ = await p.reads.get(self.store, p.node)
        if recent is None or p.now - recent.at > self.window_s or recent.event_id == p.event_id:
            return None
        done = self.catalog.weight(recent.playbook)
        # A node-wide action (reboot, reprovision) covers anything as heavy or lighter;
        # a GPU reset covers only its own GPU, which the cooldown already handles.
        if done > weight or (done == weight and weight >= NODE_WIDE):
            ago = format_duration(p.now - recent.at)
            return Drop(Reason.SUPERSEDED, f"{recent.playbook} on {p.node} {ago} ago covers this")
        return None

    async def commit(self, p: Proposal) -> None:
        if not p.acts or self._weight(p) == 0:
            return
        heavy = max(p.actions, key=lambda a: self.catalog.weight(a.playbook))
        await self.store.put(Heavy(at=p.now, playbook=heavy.playbook, event_id=p.event_id), p.node)
