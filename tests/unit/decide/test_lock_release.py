"""A stale holder's release never deletes the lock another replica took meanwhile.

Replica A's lease on node-001 ran out and replica B took the node for its own event. A's
executor, finishing late, reads the lock (still A's at that instant) and deletes it; B's
compare-and-set lands between that read and that delete. The delete names the revision
A read, so B's lock stays. Run on the in-memory KV here and on NATS KV in
tests/integration/test_locks.py.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from gpuops.bus.store import KV, Entry, MemoryKV
from gpuops.decide.lock import LockRecord, NodeLocks

NODE = "node-001"


class BetweenReadAndDelete:
    """Any KV, letting another writer in once, just before the next delete."""

    def __init__(self, inner: KV, meanwhile: Callable[[], Awaitable[None]]) -> None:
        self.inner, self.meanwhile = inner, meanwhile

    async def get(self, key: str) -> Entry | None:
        return await self.inner.get(key)

    async def put(self, key: str, value: bytes) -> int:
        return await self.inner.put(key, value)

    async def cas(self, key: str, value: bytes, revision: int) -> int | None:
        return await self.inner.cas(key, value, revision)

    async def delete(self, key: str, revision: int | None = None) -> bool:
        await self.meanwhile()
        self.meanwhile = _nothing
        return await self.inner.delete(key, revision)

    async def keys(self, prefix: str = "") -> list[str]:
        return await self.inner.keys(prefix)


async def _nothing() -> None:
    return None


def lock(event_id: str, owner: str, since: float) -> LockRecord:
    return LockRecord(
        rule="xid-79-gpu-lost",
        key=NODE,
        event_id=event_id,
        owner=owner,
        since=since,
        until=since + 60,
    )


async def race(kv: KV) -> tuple[bool, LockRecord | None]:
    """A holds, A's lease runs out, B takes the node while A releases: whether A's release
    said it gave the lock back, and who holds the node after it."""
    b = NodeLocks(kv)
    assert await b.store.cas(lock("event-A", "replica-a", 0.0), 0, NODE)

    async def b_takes_over() -> None:
        _, revision = await b.holder(NODE)
        assert await b.store.cas(lock("event-B", "replica-b", 100.0), revision, NODE)

    a = NodeLocks(BetweenReadAndDelete(kv, b_takes_over))
    released = await a.release(NODE, "event-A")
    held, _ = await b.holder(NODE)
    return released, held


async def test_a_stale_release_leaves_the_newer_lock_in_memory() -> None:
    kv = MemoryKV()
    released, held = await race(kv)
    assert not released, "A's release must say it gave nothing back"
    assert held is not None and held.event_id == "event-B", "B's lock survives A's release"
    assert await NodeLocks(kv).release(NODE, "event-B"), "B's own release still frees it"
    assert (await NodeLocks(kv).holder(NODE))[0] is None


async def test_a_release_without_the_race_frees_the_node() -> None:
    locks = NodeLocks(MemoryKV())
    assert await locks.store.cas(lock("event-A", "replica-a", 0.0), 0, NODE)
    assert not await locks.release(NODE, "event-other"), "another event's release is refused"
    assert await locks.release(NODE, "event-A")
    assert (await locks.holder(NODE))[0] is None
