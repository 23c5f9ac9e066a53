"""Who owns which partition: leases in the KV bucket `gpuops_leases`.

Each replica keeps `replica.<id>` (that it is alive) and `partition.<p>` for every
partition it owns, rewriting them with compare-and-set every `lease_s / 3`. The bucket's
entries expire `lease_s` after their last write, by the server's clock, so a replica
that dies, hangs or loses NATS loses its partitions without anyone comparing clocks.

A replica counts a lease as its own only until `lease_s - margin` after it *sent* the
renewal that succeeded: the server's expiry starts later than that, so a replica always
stops deciding before anyone else may start. Every round, each replica aims at its fair
share (ceil(partitions / live replicas)): it gives back what is over, and takes free
partitions in its own order of preference (rendezvous hashing, so replicas rarely race
for the same one and a partition tends to go back where it was).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import math
import os
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, ValidationError

from gpuops.bus.store import KV
from gpuops.clock import Clock

log = logging.getLogger(__name__)

# How much earlier than the server a replica gives up a lease it could not renew: covers
# the time a renewal took to reach the server and clocks that run at slightly other rates.
MARGIN_SHARE = 0.2


class ReplicaRecord(BaseModel):
    """A live replica, for the others' fair share and for `gpuops status`."""

    model_config = ConfigDict(frozen=True)

    id: str
    host: str
    pid: int
    started: float
    partitions: tuple[int, ...] = ()
    at: float = 0.0


class LeaseRecord(BaseModel):
    """One partition's owner; `epoch` is the KV revision it was taken at (a new owner,
    a new epoch; renewals keep it)."""

    model_config = ConfigDict(frozen=True)

    owner: str
    epoch: int = 0
    since: float = 0.0


@dataclass(slots=True)
class Held:
    """A lease this replica holds: the revision to renew from and until when it counts."""

    revision: int
    epoch: int
    valid_until: float  # time.monotonic()
    since: float


Change = Callable[[int], Awaitable[None]]


def preference(replica: str, partition: int) -> int:
    """Rendezvous weight: each replica ranks the partitions in its own stable order."""
    return int.from_bytes(hashlib.sha256(f"{replica}|{partition}".encode()).digest()[:8], "big")


def default_replica_id(state_dir: str) -> str:
    """The host's name and its state dir: stable across restarts, so a restarted engine
    takes back its own partitions at once instead of waiting for them to expire."""
    digest = hashlib.sha256(state_dir.encode()).hexdigest()[:6]
    host = "".join(c if c.isalnum() or c in "-_" else "_" for c in socket.gethostname())[:40]
    return f"{host or 'host'}-{digest}"


@dataclass
class Ownership:
    """This replica's leases: renewed, balanced, and the callbacks that start and stop
    the work of a partition."""

    kv: KV
    me: str
    partitions: int
    lease_s: float
    clock: Clock
    on_gain: Change
    on_lose: Change
    held: dict[int, Held] = field(default_factory=dict)
    started: float = field(default=0.0)
    # The newest view of the bucket, for status and metrics: partition -> owner.
    owners: dict[int, str] = field(default_factory=dict)
    replicas: dict[str, ReplicaRecord] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.started = self.clock.now()

    @property
    def every_s(self) -> float:
        """How often leases are renewed and shares balanced."""
        return self.lease_s / 3

    def holds(self, partition: int) -> bool:
        """Whether this replica may decide for the partition now."""
        held = self.held.get(partition)
        return held is not None and time.monotonic() < held.valid_until

    def mine(self) -> list[int]:
        """The partitions held, in order."""
        return sorted(self.held)

    async def run(self, stop: asyncio.Event) -> None:
        """Renew and balance every `every_s` until stopped; then give everything back."""
        try:
            while not stop.is_set():
                await self.round()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.every_s)
        finally:
            await self.release_all()

    async def round(self) -> None:
        """One renewal and balancing round."""
        await self._expire_local()
        await self._renew()
        await self._register()
        await self._balance()

    async def _expire_local(self) -> None:
        """Stop deciding for leases whose time ran out here (NATS unreachable)."""
        for p in [p for p, h in self.held.items() if time.monotonic() >= h.valid_until]:
            log.warning("lease of partition %d ran out before it was renewed; stopping it", p)
            await self._lose(p)

    async def _renew(self) -> None:
        for p, held in list(self.held.items()):
            sent = time.monotonic()
            record = LeaseRecord(owner=self.me, epoch=held.epoch, since=held.since)
            revision = await self.kv.cas(_key(p), _dump(record), held.revision)
            if revision is None:
                log.warning("partition %d was taken over by another replica; stopping it", p)
                await self._lose(p)
                continue
            held.revision, held.valid_until = revision, self._valid_until(sent)

    async def _register(self) -> None:
        record = ReplicaRecord(
            id=self.me,
            host=socket.gethostname(),
            pid=os.getpid(),
            started=self.started,
            partitions=tuple(self.mine()),
            at=self.clock.now(),
        )
        await self.kv.put(_replica_key(self.me), _dump(record))

    async def _balance(self) -> None:
        self.replicas = await read_replicas(self.kv)
        leases = await read_leases(self.kv, self.partitions)
        self.owners = {p: lease.owner for p, (lease, _) in leases.items()}
        share = math.ceil(self.partitions / len(set(self.replicas) | {self.me}))
        over = len(self.held) - share
        for p in sorted(self.held, key=lambda p: preference(self.me, p))[: max(0, over)]:
            await self.release(p)
        for p in sorted(range(self.partitions), key=lambda p: -preference(self.me, p)):
            if len(self.held) >= share:
                break
            lease, revision = leases.get(p, (None, 0))
            if p in self.held or (lease is not None and lease.owner != self.me):
                continue
            await self._take(p, revision)

    async def _take(self, p: int, revision: int) -> None:
        """Take a free partition (or one this replica held before a restart)."""
        sent, since = time.monotonic(), self.clock.now()
        got = await self.kv.cas(_key(p), _dump(LeaseRecord(owner=self.me, since=since)), revision)
        if got is None:
            return  # another replica was quicker
        # The epoch is the revision it was taken at; the next renewal writes it down.
        self.held[p] = Held(got, got, self._valid_until(sent), since)
        self.owners[p] = self.me
        log.info("took partition %d (epoch %d)", p, got)
        try:
            await self.on_gain(p)
        except Exception:
            log.exception("starting partition %d failed; giving it back", p)
            await self.release(p)

    async def release(self, p: int) -> None:
        """Stop the partition's work, then give its lease back for another replica."""
        if p not in self.held:
            return
        await self._lose(p)
        with contextlib.suppress(Exception):  # NATS away: the lease expires on its own
            await self.kv.delete(_key(p))
        log.info("gave back partition %d", p)

    async def release_all(self) -> None:
        """Give every partition back (a clean stop: the others take them at once)."""
        for p in list(self.held):
            await self.release(p)
        with contextlib.suppress(Exception):
            await self.kv.delete(_replica_key(self.me))

    async def _lose(self, p: int) -> None:
        self.held.pop(p, None)
        if self.owners.get(p) == self.me:
            del self.owners[p]
        await self.on_lose(p)

    def _valid_until(self, sent: float) -> float:
        return sent + self.lease_s * (1 - MARGIN_SHARE)


def _key(partition: int) -> str:
    return f"partition.{partition}"


def _replica_key(replica: str) -> str:
    return f"replica.{replica}"


def _dump(record: BaseModel) -> bytes:
    return record.model_dump_json().encode()


async def read_replicas(kv: KV) -> dict[str, ReplicaRecord]:
    """The live replicas, by id."""
    out: dict[str, ReplicaRecord] = {}
    for key in await kv.keys("replica."):
        entry = await kv.get(key)
        if entry is None:
            continue
        with contextlib.suppress(ValidationError):
            record = ReplicaRecord.model_validate_json(entry.value)
            out[record.id] = record
    return out


async def read_leases(kv: KV, partitions: int) -> dict[int, tuple[LeaseRecord, int]]:
    """Partition -> (its lease, the lease's revision), for the partitions someone holds."""
    out: dict[int, tuple[LeaseRecord, int]] = {}
    for p in range(partitions):
        entry = await kv.get(_key(p))
        if entry is None:
            continue
        try:
            out[p] = (LeaseRecord.model_validate_json(entry.value), entry.revision)
        except ValidationError:  # unreadable: held by someone all the same
            out[p] = (LeaseRecord(owner="?"), entry.revision)
    return out
