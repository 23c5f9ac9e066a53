"""Stage: one remediation at a time per node, held in KV with a lease.

The lock is taken with compare-and-set, so two engine replicas cannot both act on a
node. It is taken with a short pending lease while the decision is written and
extended to the full lease when it is committed, so a crash in between frees the node
within a minute. The executor gives it back through `NodeLocks.release` when the run
has ended; a holder that died loses it when the lease runs out.

A fabric check (grade 4) holds its peers too (`Proposal.peers`, picked by the
FabricPeers stage): a peer rebooted or drained mid-test would fail the pair and blame a
healthy node. Each peer's lock names the node under test (`peer_of`); all are taken,
extended and given back with the node's, and one peer already held drops the decision.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from gpuops.bus.store import KV, Read, Store, together
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
    peer_of: str = ""  # held as a fabric check's peer: the node under test


class NodeLocks:
    """The locks bucket: what the stage takes and the executor gives back."""

    def __init__(self, kv: KV) -> None:
        self.store: Store[LockRecord] = Store(kv, LockRecord, "node")

    async def holder(self, node: str) -> tuple[LockRecord | None, int]:
        """The node's lock and its revision."""
        return await self.store.get(node)

    async def held(self, now: float, but: str = "") -> set[str]:
        """The nodes locked now (leases not run out), but by the decision of event `but`
        (made again, it sees the nodes as its first try saw them)."""
        return {
            key.removeprefix("node.")
            for key, r in await self.store.all()
            if r.until > now and (not but or r.event_id != but)
        }

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
        if not p.acts:
            return ()
        return tuple(self.locks.store.read(n) for n in (p.node, *p.peers))

    async def check(self, p: Proposal) -> Drop | None:
        if not p.acts:
            return None
        for node in (p.node, *p.peers):
            dropped = await self._take(p, node)
            if dropped is not None:
                await self.abort(p)  # the locks taken so far go back
                return dropped
        p.holds_lock = True
        return None

    async def _take(self, p: Proposal, node: str) -> Drop | None:
        held, revision = await p.reads.get(self.locks.store, node)
        if held is not None and held.event_id == p.event_id:
            self._taken(p, node)  # the same event decided again after a crash: still ours
            return None
        whose = "" if node == p.node else f"fabric peer {node} of {p.node}: "
        if held is not None and held.until > p.now:
            left = format_duration(held.until - p.now)
            return Drop(
                Reason.LOCKED, f"{whose}{node} is locked by {held.rule} ({left} of lease left)"
            )
        pending = self._record(p, PENDING_LEASE_S, node)
        if not await p.reads.cas(self.locks.store, pending, revision, node):
            return Drop(Reason.LOCKED, f"{whose}{node} was locked by another replica just now")
        self._taken(p, node)
        return None

    @staticmethod
    def _taken(p: Proposal, node: str) -> None:
        p.holds_lock = True  # abort gives back what this decision holds
        if node not in p.locked:
            p.locked.append(node)

    def _record(self, p: Proposal, lease: float, node: str) -> LockRecord:
        return LockRecord(
            rule=p.rule.name,
            key=p.match.key,
            event_id=p.event_id,
            owner=self.owner,
            since=p.now,
            until=p.now + lease,
            peer_of="" if node == p.node else p.node,
        )

    async def commit(self, p: Proposal) -> None:
        if not p.holds_lock:
            return
        await together(*(self._extend(p, node) for node in p.locked))

    async def _extend(self, p: Proposal, node: str) -> None:
        full = self._record(p, self.lease_s, node)

        def extend(held: LockRecord | None) -> LockRecord | None:
            return full if held is not None and held.event_id == p.event_id else None

        await self.locks.store.update(extend, node, known=p.reads.known(self.locks.store, node))

    async def abort(self, p: Proposal) -> None:
        if p.holds_lock:
            await together(*(self.locks.release(node, p.event_id) for node in p.locked))
            p.holds_lock = False
            p.locked.clear()
