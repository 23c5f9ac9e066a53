"""Stage: one remediation at a time per node, held in KV with a lease.

The lock is taken with compare-and-set, so two engine replicas cannot both act on a
node. It is taken with a short pending lease while the decision is written and
extended to the full lease when it is committed, so a crash in between frees the node
within a minute. The executor gives it back through `NodeLocks.release` when the run
has ended; a holder that died loses it when the lease runs out.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from gpuops.bus.store import KV, Read, Store
from gpuops.decide.stage import BaseStage, Drop, Proposal
from gpuops.match.durations import format_duration
from gpuops.models import Reason

PENDING_LEASE_S = 60.0


class LockRecord(BaseModel):
    """Who holds a node, for which decision, until when."""

    model_config = ConfigDict(frozen=True)

    rule: str
    key: str
    event_id: str
    owner: str
    since: float
    until: float


class NodeLocks:
    """The locks bucket: what the stage takes and the executor gives back."""

    def __init__(self, kv: KV) -> None:
        self.store: Store[LockRecord] = Store(kv, LockRecord, "node")

    async def holder(self, node: str) -> tuple[LockRecord | None, int]:
        """The node's lock and its revision."""
        return await self.store.get(node)

    async def release(self, node: str, event_id: str) -> bool:
        """Give the node's lock back if this event's decision holds it.

        The delete names the revision read: a lock another replica took in between (the
        old one's lease ran out) is that replica's, and stays."""
        held, revision = await self.store.get(node)
        if held is None or held.event_id != event_id:
            return False
        return await self.store.delete(node, revision=revision)


class NodeLock(BaseStage):
    """Takes the node's lock for a proposal that would run something."""

    name = "lock"

    def __init__(self, locks: NodeLocks, lease_s: float = 1800.0, owner: str = "engine") -> None:
        self.locks = locks
        self.lease_s = lease_s
        self.owner = owner

    def reads(self, p: Proposal) -> Sequence[Read]:
        return (self.locks.store.read(p.node),) if p.acts else ()

    async def check(self, p: Proposal) -> Drop | None:
        if not p.acts:
            return None
        held, revision = await p.reads.get(self.locks.store, p.node)
        if held is not None and held.event_id == p.event_id:
            p.holds_lock = True  # the same event decided again after a crash: still ours
            return None
        if held is not None and held.until > p.now:
            left = format_duration(held.until - p.now)
            return Drop(Reason.LOCKED, f"{p.node} is locked by {held.rule} ({left} of lease left)")
        pending = self._record(p, PENDING_LEASE_S)
        if not await p.reads.cas(self.locks.store, pending, revision, p.node):
            return Drop(Reason.LOCKED, f"{p.node} was locked by another replica just now")
        p.holds_lock = True
        return None

    def _record(self, p: Proposal, lease: float) -> LockRecord:
        return LockRecord(
            rule=p.rule.name,
            key=p.match.key,
            event_id=p.event_id,
            owner=self.owner,
            since=p.now,
            until=p.now + lease,
        )

    async def commit(self, p: Proposal) -> None:
        if not p.holds_lock:
            return
        full = self._record(p, self.lease_s)

        def extend(held: LockRecord | None) -> LockRecord | None:
            return full if held is not None and held.event_id == p.event_id else None

        await self.locks.store.update(extend, p.node, known=p.reads.known(self.locks.store, p.node))

    async def abort(self, p: Proposal) -> None:
        if p.holds_lock:
            await self.locks.release(p.node, p.event_id)
            p.holds_lock = False
