"""A read-change-write that lost every compare-and-set says so: it is never read as
"nothing to change" (an approval believed stored, an episode believed written)."""

from __future__ import annotations

import pytest
from gpuops.bus.store import Entry, MemoryKV, Store
from gpuops.errors import BusError, Contended
from pydantic import BaseModel


class Thing(BaseModel):
    n: int


class AlwaysBeaten(MemoryKV):
    """Another writer lands between each read and its compare-and-set."""

    async def cas(self, key: str, value: bytes, revision: int) -> int | None:
        await self.put(key, b'{"n": -1}')
        return await super().cas(key, value, revision)


async def test_an_update_that_lost_every_try_raises_contended_and_wrote_nothing() -> None:
    kv = AlwaysBeaten("approvals")
    store = Store(kv, Thing, "thing")
    with pytest.raises(Contended) as caught:
        await store.update(lambda t: Thing(n=1), "a", tries=3)
    assert isinstance(caught.value, BusError), "the intake gives a BusError's event back"
    assert caught.value.key == "thing.a" and caught.value.tries == 3
    entry = await kv.get("thing.a")
    assert entry == Entry(b'{"n": -1}', kv.revision), "only the other writer's value"


async def test_nothing_to_change_is_still_the_stored_record() -> None:
    kv = MemoryKV("approvals")
    store = Store(kv, Thing, "thing")
    await store.put(Thing(n=2), "a")
    assert await store.update(lambda t: None, "a") == Thing(n=2)
    assert await store.update(lambda t: None, "b") is None, "absent, and nothing to write"
