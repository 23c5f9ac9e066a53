"""Node locks on a real NATS KV bucket: a stale holder's release, raced by another
replica's takeover between its read and its delete, leaves the newer lock in place
(the delete carries the revision read; JetStream refuses it once the key moved on)."""

from __future__ import annotations

import pytest
from gpuops.bus.conn import Bus
from gpuops.bus.store import NatsKV
from gpuops.decide.lock import NodeLocks

from tests.unit.decide.test_lock_release import NODE, race

pytestmark = pytest.mark.integration


async def test_a_stale_release_leaves_the_newer_lock_on_nats(bus: Bus) -> None:
    kv = NatsKV(bus.kv["locks"])
    released, held = await race(kv)
    assert not released, "A's release must say it gave nothing back"
    assert held is not None and held.event_id == "event-B", "B's lock survives A's release"
    assert await NodeLocks(kv).release(NODE, "event-B"), "B's own release still frees it"
    assert (await NodeLocks(kv).holder(NODE))[0] is None
