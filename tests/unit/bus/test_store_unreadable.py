"""A stored value that does not decode is never read as absent (issue 31)."""

from __future__ import annotations

import pytest
from gpuops.bus.store import MemoryKV, Reads, Store
from gpuops.errors import StateUnreadable
from gpuops.record.metrics import Metrics
from gpuops.record.unreadable import UnreadableState
from pydantic import BaseModel


class Thing(BaseModel):
    n: int


async def test_get_all_and_reads_raise_naming_bucket_and_key() -> None:
    kv = MemoryKV("control")
    store = Store(kv, Thing, "thing")
    await kv.put("thing.a", b'{"n": 1}')
    await kv.put("thing.b", b'{"n": "many"}')
    assert (await store.get("a"))[0] == Thing(n=1)
    assert await store.get("c") == (None, 0), "absent is absent"
    with pytest.raises(StateUnreadable) as caught:
        await store.get("b")
    assert (caught.value.bucket, caught.value.key) == ("control", "thing.b")
    assert "n" in caught.value.detail and caught.value.raw == b'{"n": "many"}'
    with pytest.raises(StateUnreadable):
        await store.all()
    with pytest.raises(StateUnreadable):
        await Reads().get(store, "b")
    found, bad = await store.readable()
    assert found == [("thing.a", Thing(n=1))] and [e.key for e in bad] == ["thing.b"]


async def test_update_does_not_write_over_what_it_cannot_read() -> None:
    kv = MemoryKV("nodes")
    store = Store(kv, Thing, "thing")
    await kv.put("thing.a", b"garbage")
    with pytest.raises(StateUnreadable):
        await store.update(lambda t: Thing(n=(t.n if t else 0) + 1), "a")
    entry = await kv.get("thing.a")
    assert entry is not None and entry.value == b"garbage"


async def test_each_unreadable_record_is_told_once_and_goes_when_it_reads() -> None:
    metrics = Metrics()
    told = UnreadableState(metrics)
    kv = MemoryKV("cooldowns")
    await kv.put("thing.a", b"garbage")
    exc = StateUnreadable("cooldowns", "thing.a", "Invalid JSON")
    told.note(exc)
    told.note(exc)
    assert metrics.state_unreadable.labels("cooldowns")._value.get() == 1
    assert metrics.state_unreadable_now.labels("cooldowns")._value.get() == 1
    assert [u.key for u in told.entries()] == ["thing.a"]
    assert "gpuops state repair cooldowns thing.a" in told.entries()[0].line()
    await told.recheck({"cooldowns": kv}, lambda b, k: Thing)
    assert told.entries(), "still garbage: still listed"
    await kv.put("thing.a", b'{"n": 2}')
    await told.recheck({"cooldowns": kv}, lambda b, k: Thing)
    assert told.entries() == []
    assert metrics.state_unreadable_now.labels("cooldowns")._value.get() == 0
