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

from nats.errors import Error as NatsError
from nats.js.errors import Error as JsError
from pydantic import BaseModel, ConfigDict, ValidationError

from gpuops.bus.client import away
from gpuops.bus.store import KV
from gpuops.clock import Clock
from gpuops.errors import BusError

log = logging.getLogger(__name__)

# How much earlier than the server a replica gives up a lease it could not renew: covers
# the time a renewal took to reach the server and clocks that run at slightly other rates.
MARGIN_SHARE = 0.2
# A round that failed only because NATS is away (reconnecting, its buffer full) is tried
# again after this pause, not a third of a lease later: the leases it renews are still
# held until their own time runs out (`_expire_local`), and no sooner given up.
AWAY_PAUSE_S = 0.25


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
    # Takeovers under way, beside the rounds (partition -> its task).
    gaining: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    closing: asyncio.Event = field(default_factory=asyncio.Event)  # set: take nothing more
    # Partitions whose work is stopping, beside the rounds (given back, or lost).
    stopping: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    leaving: set[int] = field(default_factory=set)  # given back: renewed until stopped

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
        self.closing = stop
        told = False  # of this outage: a round every AWAY_PAUSE_S would fill the log
        try:
            while not stop.is_set():
                began = time.monotonic()
                left = self.every_s
                try:
                    await self.round()
                    told = False
                except (BusError, NatsError, JsError, TimeoutError) as exc:
                    # NATS slow or away: the next round tries again; a lease not renewed
                    # in time stops on its own (`_expire_local`), nothing else is dropped.
                    if not told:
                        log.warning("lease round failed (%s); trying again", exc or type(exc))
                    if away(exc):
                        left, told = AWAY_PAUSE_S, True
                # Every `every_s` from the start of the last round, not after it: a round
                # that took a while on a busy host must not push the renewal past the lease.
                left = max(0.0, min(left, self.every_s - (time.monotonic() - began)))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), left)
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
            self._drop(p)

    async def _renew(self) -> None:
        """Every lease at once: on a busy host one after another could outlast a lease."""
        await asyncio.gather(*(self._renew_one(p, held) for p, held in list(self.held.items())))

    async def _renew_one(self, p: int, held: Held) -> None:
        sent = time.monotonic()
        record = LeaseRecord(owner=self.me, epoch=held.epoch, since=held.since)
        revision = await self.kv.cas(_key(p), _dump(record), held.revision)
        if self.held.get(p) is not held:
            return  # given back meanwhile
        if revision is None:
            revision = await self._landed(p, held, record)
        if revision is None:
            log.warning("partition %d was taken over by another replica; stopping it", p)
            self._drop(p)
            return
        if time.monotonic() >= held.valid_until:
            # Renewed, but answered after the lease ran out here: its consumers stopped
            # then (Replica._watch), and a lease kept now would be held with nobody
            # reading its partition. Dropped, it is taken over afresh.
            log.warning("partition %d: its renewal was answered after the lease ran out", p)
            self._drop(p)
            return
        held.revision, held.valid_until = revision, self._valid_until(sent)

    async def _landed(self, p: int, held: Held, record: LeaseRecord) -> int | None:
        """After a refused renewal: the revision of this replica's own renewal that was
        stored although its answer was lost (an outage, a timeout), renewed from there; None
        when someone else's lease is there (a taking is a new epoch) or none is."""
        entry = await self.kv.get(_key(p))
        if entry is None or entry.value != _dump(record) or entry.revision < held.revision:
            return None
        return await self.kv.cas(_key(p), _dump(record), entry.revision)

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
        kept = [p for p in self.held if p not in self.leaving]
        # Given back beside the round: each waits for its consumers to stop (renewed
        # meanwhile), and the round must go on renewing the leases kept.
        for p in sorted(kept, key=lambda p: preference(self.me, p))[: max(0, len(kept) - share)]:
            self.leaving.add(p)
            kept.remove(p)
            self.stopping[p] = asyncio.create_task(self._give_back(p))
        for p in sorted(range(self.partitions), key=lambda p: -preference(self.me, p)):
            if len(kept) >= share:
                break
            lease, revision = leases.get(p, (None, 0))
            if p in self.held or p in self.stopping:
                continue  # held, or its last work still stopping here
            if lease is not None and lease.owner != self.me:
                continue
            if await self._take(p, revision):
                kept.append(p)

    async def _take(self, p: int, revision: int) -> bool:
        """Take a free partition (or one this replica held before a restart)."""
        if self.closing.is_set():
            return False  # stopping: a takeover now would only be given back half-made
        sent, since = time.monotonic(), self.clock.now()
        got = await self.kv.cas(_key(p), _dump(LeaseRecord(owner=self.me, since=since)), revision)
        if got is None:
            return False  # another replica was quicker
        # The epoch is the revision it was taken at; the next renewal writes it down.
        self.held[p] = Held(got, got, self._valid_until(sent), since)
        self.owners[p] = self.me
        log.info("took partition %d (epoch %d)", p, got)
        # Beside the round, not in it: a takeover reads the stream for a second or more on
        # a busy host, and the leases already held must be renewed meanwhile, or a replica
        # taking several partitions lets the others lapse.
        self.gaining[p] = asyncio.create_task(self._gain(p))
        return True

    async def _gain(self, p: int) -> None:
        try:
            while True:
                try:
                    await self.on_gain(p)
                    break
                except Exception as exc:
                    # NATS away or too slow halfway through (a restart's backlog, every
                    # partition taken over at once): start it again while the lease
                    # holds; giving it back would only move the same work elsewhere.
                    again = away(exc) or isinstance(exc, TimeoutError)
                    if not again or not self.holds(p) or self.closing.is_set():
                        raise
                    log.info("starting partition %d: %s; starting it again", p, _why(exc))
                    await self.on_lose(p)  # what the half-made start warmed is forgotten
                    await asyncio.sleep(AWAY_PAUSE_S)
        except Exception:
            log.exception("starting partition %d failed; giving it back", p)
            self.gaining.pop(p, None)
            await self.release(p)
        finally:
            self.gaining.pop(p, None)

    async def release(self, p: int) -> None:
        """Stop the partition's work, then give its lease back for another replica."""
        if p in self.held:
            self.leaving.add(p)
            await self._give_back(p)

    async def _give_back(self, p: int) -> None:
        """Stop the work while the lease is still renewed, then drop the lease and delete
        it (only at the revision renewed last: if it lapsed and another replica took the
        partition meanwhile, that replica's lease stays)."""
        try:
            await self._stop_work(p)
        finally:
            held = self.held.pop(p, None)
            self.leaving.discard(p)
            self.stopping.pop(p, None)
            if self.owners.get(p) == self.me:
                del self.owners[p]
            if held is not None:
                with contextlib.suppress(Exception):  # NATS away: it expires on its own
                    await self.kv.delete(_key(p), held.revision)
                log.info("gave back partition %d", p)

    async def release_all(self) -> None:
        """Give every partition back (a clean stop: the others take them at once)."""
        await asyncio.gather(*(self.release(p) for p in list(self.held) if p not in self.leaving))
        await asyncio.gather(*self.stopping.values(), return_exceptions=True)
        with contextlib.suppress(Exception):
            await self.kv.delete(_replica_key(self.me))

    def _drop(self, p: int) -> None:
        """A lease lost (ran out, or taken over): no longer held from now; its work stops
        beside the round."""
        self.held.pop(p, None)
        self.leaving.discard(p)
        if self.owners.get(p) == self.me:
            del self.owners[p]
        if p not in self.stopping:
            self.stopping[p] = asyncio.create_task(self._stopped(p))

    async def _stopped(self, p: int) -> None:
        try:
            await self._stop_work(p)
        finally:
            self.stopping.pop(p, None)

    async def _stop_work(self, p: int) -> None:
        gain = self.gaining.pop(p, None)
        if gain is not None and gain is not asyncio.current_task():
            # Still being taken over: the takeover ends first, not halfway (its durable
            # deleted and not made again would send the next owner back to the
            # partition's first message).
            with contextlib.suppress(Exception):
                await asyncio.shield(gain)
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


def _why(exc: BaseException) -> str:
    return "NATS away" if away(exc) else f"NATS too slow ({type(exc).__name__})"


async def read_leases(kv: KV, partitions: int) -> dict[int, tuple[LeaseRecord, int]]:
    """Partition -> (its lease, the lease's revision), for the partitions someone holds.

    A lease not yet renewed does not hold its epoch (the revision its taking got, known
    only after the write): read back, it is given that revision as its epoch."""
    out: dict[int, tuple[LeaseRecord, int]] = {}
    entries = await asyncio.gather(*(kv.get(_key(p)) for p in range(partitions)))
    for p, entry in enumerate(entries):
        if entry is None:
            continue
        try:
            record = LeaseRecord.model_validate_json(entry.value)
        except ValidationError:  # unreadable: held by someone all the same
            record = LeaseRecord(owner="?")
        if not record.epoch:
            record = record.model_copy(update={"epoch": entry.revision})
        out[p] = (record, entry.revision)
    return out
