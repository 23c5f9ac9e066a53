"""Node locks on a real NATS KV bucket: a stale holder's release, raced by another
replica's takeover between its read and its delete, leaves the newer lock in place
(the delete carries the revision read; JetStream refuses it once the key moved on)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from gpuops.bus.conn import Bus
from gpuops.bus.store import NatsKV
from gpuops.decide.lock import NodeLocks

from tests.unit.decide.test_lock_release import NODE, race

pytestmark = pytest.mark.integration


class BetweenReadAndDelete(NatsKV):
    """The locks bucket, letting another replica in just before each delete."""

    meanwhile: Callable[[], Awaitable[None]] | None = None

    async def delete(self, key: str, revision: int | None = None) -> bool:
        if self.meanwhile is not None:
            step, self.meanwhile = self.meanwhile, None
            await step()
        return await super().delete(key, revision)


async def test_a_stale_release_leaves_the_newer_lock_on_nats(bus: Bus) -> None:
    kv = BetweenReadAndDelete(bus.kv["locks"])

    def set_meanwhile(step: Callable[[], Awaitable[None]]) -> None:
        kv.meanwhile = step

    released, held = await race(kv, set_meanwhile)
    assert not released, "A's release must say it gave nothing back"
    assert held is not None and held.event_id == "event-B", "B's lock survives A's release"
    assert await NodeLocks(kv).release(NODE, "event-B"), "B's own release still frees it"
    assert (await NodeLocks(kv).holder(NODE))[0] is None
