"""Typed state in KV: frozen pydantic records, read and written with compare-and-set.

`KV` is the small interface the stages need; `NatsKV` puts it over a JetStream bucket
and `MemoryKV` keeps it in a dict (tests, `replay`, `test-rules`), so no stage branches
on where its state lives. `Store[T]` reads and writes one record type under a prefix.
`Reads` holds what one decision read, fetched in one concurrent round; `together`
awaits independent calls concurrently.
"""

from __future__ import annotations

import asyncio
import fnmatch
import functools
import random
import re
from collections.abc import Awaitable, Callable, Coroutine, Generator, Iterable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import (
    BadRequestError,
    KeyDeletedError,
    KeyNotFoundError,
    KeyWrongLastSequenceError,
)
from nats.js.kv import KeyValue
from pydantic import BaseModel, ValidationError

from gpuops.bus.reader import one_read
from gpuops.errors import BusError, Contended, StateUnreadable

# JetStream's codes for "the key is past the revision you named" (stream and KV forms).
WRONG_LAST_SEQUENCE = frozenset({10071, 10164})

T = TypeVar("T", bound=BaseModel)
R = TypeVar("R")
_UNSAFE = re.compile(r"[^-/_=.a-zA-Z0-9]")


# A decision names a dozen records, each several times (every stage's reads are asked
# for again as the proposal moves on), from a few rules and the fleet's nodes: the keys
# are remembered rather than sanitised by a regular expression at every ask.
@functools.lru_cache(maxsize=1 << 16)
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

    name: str  # the bucket's purpose (gpuops.bus.buckets), in errors and repairs

    async def get(self, key: str) -> Entry | None:
        """The entry, or None when absent or deleted."""
        ...

    async def put(self, key: str, value: bytes) -> int:
        """Store unconditionally; the new revision."""
        ...

    async def cas(self, key: str, value: bytes, revision: int) -> int | None:
        """Store if the key is still at `revision` (0: only if absent); None if someone won."""
        ...

    async def delete(self, key: str, revision: int | None = None) -> bool:
        """Remove the key (absent keys are fine); with `revision`, only if it is still at
        that revision (someone else's newer value stays). False when that kept it."""
        ...

    async def keys(self, prefix: str = "") -> list[str]:
        """Keys under a prefix."""
        ...


class NatsKV:
    """KV over a JetStream key-value bucket."""

    def __init__(self, bucket: KeyValue, name: str = "") -> None:
        self.bucket = bucket
        self.name = name
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

    async def delete(self, key: str, revision: int | None = None) -> bool:
        try:
            await self.bucket.delete(key, last=revision)
        except KeyWrongLastSequenceError:
            return False  # written again since `revision`: the newer value stays
        except BadRequestError as exc:
            # nats-py turns "wrong last sequence" into KeyWrongLastSequenceError on update,
            # not on delete: there it is a bare 400 with JetStream's error code.
            if exc.err_code in WRONG_LAST_SEQUENCE:
                return False
            raise
        except (KeyNotFoundError, KeyDeletedError):
            return True
        return True

    async def keys(self, prefix: str = "") -> list[str]:
        # The bucket's newest message per key, headers only, read through a consumer the
        # server removes soon after (gpuops.bus.reader): KeyValue.keys and watch leave
        # theirs on the server, and listing every second would reach its limit of consumers. The
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

    def __init__(self, name: str = "") -> None:
        self.name = name
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

    async def delete(self, key: str, revision: int | None = None) -> bool:
        current = self.data.get(key)
        if revision is not None and (current.revision if current else 0) != revision:
            return False
        self.data.pop(key, None)
        return True

    async def keys(self, prefix: str = "") -> list[str]:
        return [k for k in self.data if fnmatch.fnmatchcase(k, f"{prefix}*")]


# Records decoded, per store, kept with the entry they came from (at most this many):
# a decision reads its node's records again at each stage and commit, and records are
# frozen, so one decoded from the same bytes is the same record.
DECODED_MAX = 4096


class Store(Generic[T]):
    """Records of one type under `prefix.` in a KV."""

    def __init__(self, kv: KV, model: type[T], prefix: str) -> None:
        self.kv = kv
        self.model = model
        self.prefix = prefix
        self._decoded: dict[str, tuple[Entry, T]] = {}

    def key(self, *parts: str) -> str:
        """The KV key of a record (parts sanitised)."""
        return kv_key(self.prefix, *parts)

    def read(self, *parts: str) -> Read:
        """The record under `parts`, named for `Reads.fetch`."""
        return Read(self, parts, (self.kv, self.key(*parts)))

    async def get(self, *parts: str) -> tuple[T | None, int]:
        """The record and its revision; (None, 0) when absent; StateUnreadable when it is
        there but does not decode (never "absent": see gpuops.errors)."""
        key = self.key(*parts)
        return self.decode(await self.kv.get(key), key)

    def decode(self, entry: Entry | None, key: str) -> tuple[T | None, int]:
        """An entry as (record, revision), as `get` returns it."""
        if entry is None:
            return None, 0
        held = self._decoded.get(key)
        if held is not None and (held[0] is entry or held[0].value == entry.value):
            return held[1], entry.revision
        try:
            record = self.model.model_validate_json(entry.value)
        except ValidationError as exc:
            raise StateUnreadable(self.kv.name, key, _first_error(exc), entry.value) from None
        if key not in self._decoded and len(self._decoded) >= DECODED_MAX:
            del self._decoded[next(iter(self._decoded))]  # the longest held
        self._decoded[key] = (entry, record)
        return record, entry.revision

    async def put(self, value: T, *parts: str) -> int:
        """Store unconditionally."""
        return await self.kv.put(self.key(*parts), value.model_dump_json().encode())

    async def cas(self, value: T, revision: int, *parts: str) -> bool:
        """Store only if still at `revision`; False if another writer won."""
        done = await self.kv.cas(self.key(*parts), value.model_dump_json().encode(), revision)
        return done is not None

    async def delete(self, *parts: str, revision: int | None = None) -> bool:
        """Remove a record; with `revision`, only if nobody wrote it since (False if kept)."""
        return await self.kv.delete(self.key(*parts), revision)

    async def update(
        self,
        change: Callable[[T | None], T | None],
        *parts: str,
        tries: int = 8,
        known: tuple[T | None, int] | None = None,
    ) -> T | None:
        """Read, change, compare-and-set, retrying when another writer won; the stored value.

        `change` returning None leaves the record as it is. `known` (a record and revision
        read a moment ago) saves the first read: only a write is trusted to it, since the
        compare-and-set proves it current; "nothing to change" is checked on a fresh read.
        Contended when every try lost: None would read as "nothing to change".
        """
        for attempt in range(tries):
            current, revision = known or await self.get(*parts)
            new = change(current)
            if new is None or new == current:
                if known is None:
                    return current
                known = None
                continue
            known = None
            if await self.cas(new, revision, *parts):
                return new
            await contended(attempt)  # another writer won
        raise Contended(self.key(*parts), tries)

    async def all(self) -> list[tuple[str, T]]:
        """Every record with its key; StateUnreadable if one does not decode (a stage
        that cannot read one silence cannot tell which nodes it silences)."""
        found, unreadable = await self.readable()
        if unreadable:
            raise unreadable[0]
        return found

    async def readable(self) -> tuple[list[tuple[str, T]], list[StateUnreadable]]:
        """Every record that decodes, with its key, and what did not (for views: a
        status lists what it can and names the rest)."""
        keys = await self.kv.keys(self.prefix + ".")
        entries = await together(*(self.kv.get(key) for key in keys))
        found: list[tuple[str, T]] = []
        unreadable: list[StateUnreadable] = []
        for key, entry in zip(keys, entries, strict=True):
            try:
                value, _ = self.decode(entry, key)
            except StateUnreadable as exc:
                unreadable.append(exc)
                continue
            if value is not None:
                found.append((key, value))
        return found, unreadable


def _first_error(exc: ValidationError) -> str:
    """The first thing wrong with a stored value, in a few words."""
    errors = exc.errors()
    if not errors:
        return "invalid"
    where = ".".join(str(part) for part in errors[0]["loc"])
    return f"{where + ': ' if where else ''}{errors[0]['msg']}"[:200]


@dataclass(frozen=True, slots=True)
class Read:
    """One record a check will read: its store and key parts, and which bucket and key
    (two stores on one bucket never share a key: prefixes). Made by `Store.read`."""

    store: Store[Any]
    parts: tuple[str, ...]
    slot: tuple[KV, str]


class Reads:
    """The KV entries one decision read, so its checks need not wait on them one by one.

    The decider fetches what its stages name in one concurrent round; a check reads from
    here (a record nobody named is read when asked); a commit starts its compare-and-set
    from the revision read, and a writer in between makes it read again (`Store.update`).
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[KV, str], Entry | None] = {}

    def has(self, reads: Iterable[Read]) -> bool:
        """Whether every record of `reads` was fetched (a check then reads none anew)."""
        return all(r.slot in self._entries for r in reads)

    def missing(self, reads: Iterable[Read]) -> list[Read]:
        """Those of `reads` not fetched yet (each once)."""
        out: dict[tuple[KV, str], Read] = {}
        for r in reads:
            if r.slot not in self._entries:
                out.setdefault(r.slot, r)
        return list(out.values())

    async def fetch(self, reads: Iterable[Read]) -> None:
        """Read every record of `reads` not read yet, all at once."""
        todo = self.missing(reads)
        entries = await together(*(kv.get(key) for kv, key in (r.slot for r in todo)))
        self._entries.update(zip((r.slot for r in todo), entries, strict=True))

    async def get(self, store: Store[T], *parts: str) -> tuple[T | None, int]:
        """The record and its revision as fetched (read now if it was not)."""
        read = store.read(*parts)
        if read.slot not in self._entries:
            await self.fetch([read])
        return store.decode(self._entries[read.slot], read.slot[1])

    def known(self, store: Store[T], *parts: str) -> tuple[T | None, int] | None:
        """The record and revision fetched, for `Store.update(known=...)`; None if never read."""
        slot = store.read(*parts).slot
        return store.decode(self._entries[slot], slot[1]) if slot in self._entries else None

    async def cas(self, store: Store[T], value: T, revision: int, *parts: str) -> bool:
        """`Store.cas`, remembering what it wrote so a commit can start from it."""
        data = value.model_dump_json().encode()
        done = await store.kv.cas(store.key(*parts), data, revision)
        if done is not None:
            self._entries[store.read(*parts).slot] = Entry(data, done)
        return done is not None


# Compare-and-set tries before a stage gives up (BusError: the pipeline decides again).
CAS_TRIES = 16
CAS_PAUSE_MAX_S = 0.1


async def contended(lost: int) -> None:
    """Sit out the `lost`th lost compare-and-set (0: the first) before reading again: a
    random pause of up to 2 ms, doubling with each loss, at most 100 ms. Deciders racing
    for one record (a storm's partitions, replicas) then spread out; read again at once,
    they lose again in the same turns of a loaded loop, and sixteen tries ran out (CI)."""
    await asyncio.sleep(random.uniform(0.0, min(CAS_PAUSE_MAX_S, 0.002 * 2**lost)))


async def together(*calls: Awaitable[R]) -> list[R]:
    """Await independent calls concurrently; once all have ended, raise the first failure.

    Waiting for all keeps a failed call from leaving the others running unobserved, and the
    failure keeps its own type (the intake tells a bus error from a bad event by it).

    Each call is started at once, in order, as gather's tasks would start: one that ends
    without waiting (a memory store: replay, test-rules, the shadow) costs no task, so a
    decision's dozen reads and writes cost calls, not a dozen tasks and loop turns. One
    that waits (a round trip to NATS) goes on in a task of its own, as with gather. Until
    its first wait a call runs in the caller's task (Python 3.12's eager tasks run it in
    its own): none of these calls asks for its task (asyncio.timeout, current_task).
    """
    if len(calls) == 1:
        return [await calls[0]]
    started = [_start(call) for call in calls]
    waiting = [task for task in started if isinstance(task, _Waiting)]
    if waiting:
        await asyncio.gather(*(w.task for w in waiting), return_exceptions=True)
    out: list[R] = []
    for one in started:
        result = one.outcome() if isinstance(one, _Waiting) else one
        if isinstance(result, BaseException):
            raise result
        out.append(result)
    return out


@dataclass(frozen=True, slots=True)
class _Waiting(Generic[R]):
    """A started call that waits, going on in its task."""

    task: asyncio.Future[R]

    def outcome(self) -> R | BaseException:
        if self.task.cancelled():
            return asyncio.CancelledError()
        return self.task.exception() or self.task.result()


def _start(call: Awaitable[R]) -> R | BaseException | _Waiting[R]:
    """Run a call until it first waits: its result or failure if it never does, else
    the task that goes on from there."""
    if not asyncio.iscoroutine(call):
        return _Waiting(asyncio.ensure_future(call))
    try:
        waits_on = call.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    except (Exception, asyncio.CancelledError) as exc:
        return exc
    return _Waiting(asyncio.ensure_future(_Rest(call, waits_on)))


class _Rest(Coroutine[Any, R, R]):
    """The rest of a started call, as a task's coroutine: the task's first step takes the
    wait the call is in; whatever is thrown in goes to the call, even before that step (a
    caller cancelled before its calls' tasks ran: each call still sees the cancellation)."""

    __slots__ = ("call", "started", "waits_on")

    def __init__(self, call: Coroutine[Any, Any, R], waits_on: Any) -> None:
        self.call, self.waits_on, self.started = call, waits_on, False

    def send(self, value: Any) -> Any:
        if not self.started:
            self.started = True
            return self.waits_on
        return self.call.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        if not self.started:  # the wait the call is in is nobody's now, as a task's would be
            self.started = True
            if asyncio.isfuture(self.waits_on):
                self.waits_on.cancel()
        return self.call.throw(typ) if val is None and tb is None else self.call.throw(typ, val, tb)

    def close(self) -> None:
        self.call.close()

    def __await__(self) -> Generator[Any, Any, R]:
        return self  # an iterator of its own, as a native coroutine's wrapper is

    def __iter__(self) -> _Rest[R]:
        return self

    def __next__(self) -> Any:
        return self.send(None)


Change = Callable[[T | None], Awaitable[T | None]]
