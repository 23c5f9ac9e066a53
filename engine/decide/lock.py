"""Stage: one remediation at a time per node, held in KV with a lease.

The lock is taken with compare-and-set, so two engine replicas cannot both act on a
node; the executor gives it back when the run has ended; a holder that died loses it
when the lease runs out.
"""

from __future__ import annotations

from nats.js.kv import KeyValue

from engine.bus.kvjson import cas_json, get_json, kv_key
from engine.decide.stage import BaseStage, Drop, Proposal
from engine.match.durations import format_duration
from engine.models import Reason


def lock_key(node: str) -> str:
    """The lock's key for a node."""
    return kv_key("node", node)


class NodeLock(BaseStage):
    """Takes the node's lock for a proposal that would run something."""

    name = "lock"

    def __init__(self, kv: KeyValue, lease_s: float = 1800.0, owner: str = "engine") -> None:
        self.kv = kv
        self.lease_s = lease_s
        self.owner = owner

    async def check(self, p: Proposal) -> Drop | None:
        if not p.actions or p.dry_run:
            return None
        key = lock_key(p.node)
        held, revision = await get_json(self.kv, key)
        if held is not None and held.get("until", 0) > p.now:
            left = format_duration(held["until"] - p.now)
            return Drop(
                Reason.LOCKED, f"{p.node} is locked by {held.get('rule')} ({left} of lease left)"
            )
        value = {
            "rule": p.rule.name,
            "key": p.match.key,
            "event": p.match.event_id,
            "owner": self.owner,
            "since": p.now,
            "until": p.now + self.lease_s,
        }
        if not await cas_json(self.kv, key, value, revision):
            return Drop(Reason.LOCKED, f"{p.node} was locked by another replica just now")
        p.notes.append(f"lock {p.node}")
        return None

    async def abort(self, p: Proposal) -> None:
        if f"lock {p.node}" in p.notes:
            await release(self.kv, p.node, p.match.event_id)


async def release(kv: KeyValue, node: str, event_id: str | None = None) -> None:
    """Give the node's lock back (only if this event's proposal holds it, when given)."""
    held, _ = await get_json(kv, lock_key(node))
    if held is not None and (event_id is None or held.get("event") == event_id):
        await kv.delete(lock_key(node))
