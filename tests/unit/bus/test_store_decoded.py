"""A store decodes a record once per stored value: the same bytes give the same frozen
record, other bytes are decoded afresh, and a value that does not decode still raises."""

from __future__ import annotations

import pytest
from gpuops.bus import store as store_module
from gpuops.bus.store import Entry, MemoryKV, Store
from gpuops.errors import StateUnreadable
from pydantic import BaseModel, ConfigDict


class Thing(BaseModel):
    model_config = ConfigDict(frozen=True)
    n: int


async def test_the_same_value_is_decoded_once_and_a_new_one_again() -> None:
    kv = MemoryKV("control")
    store = Store(kv, Thing, "thing")
    await kv.put("thing.a", b'{"n": 1}')
    first, rev = await store.get("a")
    again, _ = await store.get("a")
    assert first == Thing(n=1) and again is first  # not validated a second time
    # The same bytes at another revision (a NATS get makes new objects): the same record.
    same = store.decode(Entry(b'{"n": 1}', rev + 5), "thing.a")
    assert same == (first, rev + 5)
    await kv.put("thing.a", b'{"n": 2}')
    assert (await store.get("a"))[0] == Thing(n=2)
    await kv.put("thing.a", b'{"n": "many"}')
    with pytest.raises(StateUnreadable):
        await store.get("a")
    await kv.put("thing.a", b'{"n": 1}')
    assert (await store.get("a"))[0] == Thing(n=1)


async def test_at_most_its_bound_of_records_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_module, "DECODED_MAX", 3)
    kv = MemoryKV("control")
    store = Store(kv, Thing, "thing")
    for i in range(10):
        await kv.put(f"thing.k{i}", f'{{"n": {i}}}'.encode())
        assert (await store.get(f"k{i}"))[0] == Thing(n=i)
    assert len(store._decoded) == 3
    assert (await store.get("k0"))[0] == Thing(n=0)  # gone from memory, read again
