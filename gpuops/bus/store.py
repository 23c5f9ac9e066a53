"""Typed state in KV: frozen pydantic records, read and written with compare-and-set.

`KV` is the small interface the stages need; `NatsKV` puts it over a JetStream bucket
and `MemoryKV` keeps it in a dict (tests, `replay`, `test-rules`), so no stage branches
on where its state lives. `Store[T]` reads and writes one record type under a prefix.
"""

from __future__ import annotations

import asyncio
import fnmatch
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import (
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
)
from nats.js.kv import KeyValue
from pydantic import BaseModel, ValidationError

from gpuops.bus.reader import one_read
from gpuops.errors import BusError

T = TypeVar("T", bound=BaseModel)
_UNSAFE = re.compile(r"[^-/_=.a-zA-Z0-9]")


def kv_key(*parts: str) -> str:
    """A KV key from parts (anything outside the allowed characters becomes `_`)."""
    return ".".join(_UNSAFE.sub("_", p) for p in parts)


@dataclass(frozen=True, slots=True)
class Entry:
    """A value and the revision it was stored at."""

    value: bytes
    revision: int


class KV(Protocol):
    """Get, put, compare-and-set, delete and list keys."""

    async def get(self, key: str) -> Entry | None:
        """The entry, or None when absent or deleted."""
        ...

    async def put(self, key: str, value: bytes) -> int:
        """Store unconditionally; the new revision."""
        ...

    async def cas(self, key: str, value: bytes, revision: int) -> int | None:
        """Store if the key is still at `revision` (0: only if absent); None if someone won."""
        ...

    async def delete(self, key: str) -> None:
        """Remove the key (absent keys are fine)."""
        ...

    async def keys(self, prefix: str = "") -> list[str]:
        """Keys under a prefix."""
        ...


class NatsKV:
    """KV over a JetStream key-value bucket."""

    def __init__(self, bucket: KeyValue) -> None:
        self.bucket = bucket
        self._name: str | None = None  # the bucket's name, asked once

    async def get(self, key: str) -> Entry | None:
        try:
            entry = await self.bucket.get(key)
        except (KeyNotFoundError, KeyDeletedError):
            return None
        if not entry.value:
            return None
        return Entry(entry.value, entry.revision or 0)

    async def put(self, key: str, value: bytes) -> int:
        return int(await self.bucket.put(key, value))

    async def cas(self, key: str, value: bytes, revision: int) -> int | None:
        try:
            if revision == 0:
                return int(await self.bucket.create(key, value))
            return int(await self.bucket.update(key, value, last=revision))
        except KeyWrongLastSequenceError:
            return None

    async def delete(self, key: str) -> None:
        try:
            await self.bucket.delete(key)
        except (KeyNotFoundError, KeyDeletedError):
            return

    async def keys(self, prefix: str = "") -> list[str]:
        # The bucket's newest message per key, headers only, read through a consumer that
        # is deleted after (gpuops.bus.reader): KeyValue.keys and watch leave theirs on
        # the server, and listing every second would reach its limit of consumers. The
        # filter `prefix>` is applied by the server.
        if self._name is None:
            self._name = (await self.bucket.status()).bucket
        pre = f"$KV.{self._name}."
        stream, subject = f"KV_{self._name}", f"{pre}{prefix}>"
        config = ConsumerConfig(deliver_policy=DeliverPolicy.LAST_PER_SUBJECT, headers_only=True)
        found: list[str] = []
        async with one_read(self.bucket._js, subject, stream, config) as sub:
            left = (await sub.consumer_info()).num_pending or 0
            while left > 0:
                try:
                    msgs = await sub.fetch(min(left, 1024), timeout=2.0)
                except (NatsTimeout, TimeoutError) as exc:
                    # A short list would read as "no such silence": fail, do not guess.
                    raise BusError(f"listing {self._name} cut short ({left} keys unread)") from exc
                for msg in msgs:
                    if (msg.headers or {}).get("KV-Operation") in (None, "PUT"):
                        found.append(msg.subject.removeprefix(pre))
                left = msgs[-1].metadata.num_pending or 0 if msgs else 0
        return found


class MemoryKV:
    """KV in a dict, with revisions, for tests and shadow runs."""

    def __init__(self) -> None:
        self.data: dict[str, Entry] = {}
        self.revision = 0
        self._lock = asyncio.Lock()

    async def get(self, key: str) -> Entry | None:
        return self.data.get(key)

    async def put(self, key: str, value: bytes) -> int:
        self.revision += 1
        self.data[key] = Entry(value, self.revision)
        return self.revision

    async def cas(self, key: str, value: bytes, revision: int) -> int | None:
        async with self._lock:
            current = self.data.get(key)
            if (current.revision if current else 0) != revision:
                return None
            return await self.put(key, value)

    async def delete(self, key: str) -> None:
        self.data.pop(key, None)

    async def keys(self, prefix: str = "") -> list[str]:
        return [k for k in self.data if fnmatch.fnmatchcase(k, f"{prefix}*")]


class Store(Generic[T]):
    """Records of one type under `prefix.` in a KV."""

    def __init__(self, kv: KV, model: type[T], prefix: str) -> None:
        self.kv = kv
        self.model = model
        self.prefix = prefix

    def key(self, *parts: str) -> str:
        """The KV key of a record (parts sanitised)."""
        return kv_key(self.prefix, *parts)

    async def get(self, *parts: str) -> tuple[T | None, int]:
        """The record and its revision; (None, 0) when absent. Unreadable counts as absent."""
        entry = await self.kv.get(self.key(*parts))
        if entry is None:
            return None, 0
        try:
            return self.model.model_validate_json(entry.value), entry.revision
        except ValidationError:
            return None, entry.revision

    async def put(self, value: T, *parts: str) -> int:
        """Store unconditionally."""
        return await self.kv.put(self.key(*parts), value.model_dump_json().encode())

    async def cas(self, value: T, revision: int, *parts: str) -> bool:
        """Store only if still at `revision`; False if another writer won."""
        done = await self.kv.cas(self.key(*parts), value.model_dump_json().encode(), revision)
        return done is not None

    async def delete(self, *parts: str) -> None:
        """Remove a record."""
        await self.kv.delete(self.key(*parts))

    async def update(
        self, change: Callable[[T | None], T | None], *parts: str, tries: int = 8
    ) -> T | None:
        """Read, change, compare-and-set, retrying when another writer won; the stored value.

        `change` returning None leaves the record as it is.
        """
        for _ in range(tries):
            current, revision = await self.get(*parts)
            new = change(current)
            if new is None or new == current:
                return current
            if await self.cas(new, revision, *parts):
                return new
        return None

    async def all(self) -> list[tuple[str, T]]:
        """Every readable record with its key."""
        out: list[tuple[str, T]] = []
        for key in await self.kv.keys(self.prefix + "."):
            entry = await self.kv.get(key)
            if entry is None:
                continue
            try:
                out.append((key, self.model.model_validate_json(entry.value)))
            except ValidationError:
                continue
        return out


Change = Callable[[T | None], Awaitable[T | None]]
