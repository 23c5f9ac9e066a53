"""This engine as one replica: the partitions it owns, each taken over and consumed.

A partition is worked on by one pair of durable consumers (its health events and its
telemetry), whoever owns it. Gaining one: rebuild its windows from the stream, expect
its nodes (so an `absent` rule notices one that never reports), start its consumers.
Losing one: stop deciding for its nodes at once (the pipeline asks `owns` before every
decision and before every intent it writes), stop its consumers, drop its state.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from nats.js import JetStreamContext

from gpuops.bus.client import away
from gpuops.bus.conn import EVENTS, TELEMETRY
from gpuops.bus.partitions import (
    durable,
    events_filter,
    events_transform,
    partition_of,
    telemetry_filter,
    telemetry_transform,
)
from gpuops.bus.store import KV
from gpuops.clock import Clock
from gpuops.errors import ConfigError, ConsumerGone, LeaseLost
from gpuops.intake.compact import FactsBook
from gpuops.intake.consumer import Intake
from gpuops.match.matcher import Matcher
from gpuops.record.metrics import Metrics
from gpuops.scale.leases import AWAY_PAUSE_S, Ownership, read_leases
from gpuops.scale.takeover import Takeover, take_over

log = logging.getLogger(__name__)

# A partition given back finishes the batch in hand for at most this long.
STOP_WAIT_S = 10.0
# Telemetry is kept for minutes: a takeover replays at most what the stream still has.
TELEMETRY_SPAN_MAX_S = 600.0
# Streams taken over at once (two per partition): after a restart every partition is
# taken over together, each replaying thousands of samples; all at once on a small host,
# their JetStream calls time out and every takeover starts again.
TAKEOVERS_AT_ONCE = 4

MakeIntake = Callable[[str, bool, int, str], Intake]  # (stream, telemetry?, partition, durable)


@dataclass
class Worker:
    """One partition's consumers, running."""

    stop: asyncio.Event
    task: asyncio.Task[None]


@dataclass
class Partitions:
    """The partitions this replica owns and the work on each."""

    js: JetStreamContext
    kv: KV
    me: str
    count: int
    lease_s: float
    clock: Clock
    matcher: Matcher
    hosts: frozenset[str]
    make_intake: MakeIntake
    metrics: Metrics
    facts: FactsBook | None = None  # telemetry v2's static facts, which the intakes share
    ownership: Ownership = field(init=False)
    workers: dict[int, Worker] = field(init=False, default_factory=dict)
    ready: set[int] = field(init=False, default_factory=set)
    # (telemetry?, partition) -> the name of the consumer this replica made for it
    names: dict[tuple[bool, int], str] = field(init=False, default_factory=dict)
    _releasing: set[asyncio.Task[None]] = field(init=False, default_factory=set)
    _nodes: dict[int, frozenset[str]] = field(init=False, default_factory=dict)
    _takeovers: asyncio.Semaphore = field(
        init=False, default_factory=lambda: asyncio.Semaphore(TAKEOVERS_AT_ONCE)
    )
    _partition: dict[str, int] = field(init=False, default_factory=dict)  # node -> partition

    def __post_init__(self) -> None:
        self.ownership = Ownership(
            self.kv, self.me, self.count, self.lease_s, self.clock, self.gain, self.lose
        )
        by_partition: dict[int, set[str]] = {}
        for node in self.hosts:
            by_partition.setdefault(partition_of(node, self.count), set()).add(node)
        self._nodes = {p: frozenset(nodes) for p, nodes in by_partition.items()}
        self._partition = {n: p for p, nodes in by_partition.items() for n in nodes}

    def owns(self, node: str) -> bool:
        """Whether this replica decides for the node now (its partition is held and warm).

        Asked for every event: the node's partition is looked up, not hashed again."""
        p = self._partition.get(node)
        if p is None:
            p = partition_of(node, self.count)
        return p in self.ready and self.ownership.holds(p)

    def unowned(self) -> list[int]:
        """The partitions no replica holds (as last seen): nobody decides their nodes."""
        return [p for p in range(self.count) if p not in self.ownership.owners]

    def shared_with_others(self, nodes: frozenset[str]) -> bool:
        """Whether another replica owns the partition of some of these nodes (as last seen)."""
        owners = self.ownership.owners
        return any(
            owners.get(p, self.me) != self.me for p in {partition_of(n, self.count) for n in nodes}
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Hold leases and work on what they give until stopped."""
        await check_layout(self.js, self.count)
        try:
            await self.ownership.run(stop)
        finally:
            for p in list(self.workers):
                await self.lose(p)

    async def gain(self, p: int) -> None:
        """Take the partition over and start its consumers."""
        began = time.monotonic()
        held = self.ownership.held.get(p)
        if held is None:
            return  # lost again before its takeover began
        await self._take_both(p, held.epoch)
        self.matcher.seed(self._nodes.get(p, frozenset()), self.clock.now())
        stop = asyncio.Event()
        self.workers[p] = Worker(stop, asyncio.create_task(self._consume(p, stop)))
        self.ready.add(p)
        self.metrics.takeover_seconds.observe(time.monotonic() - began)
        self.metrics.partitions_held.set(len(self.ready))

    async def _take_both(self, p: int, epoch: int) -> None:
        """Take both streams over at once: each takeover waits on the cluster (consumers
        made and deleted through its metadata leader), and the matcher's windows are per
        kind. When one fails the other is stopped before the failure goes on: the gain is
        then tried again on windows cleared, and a takeover still replaying into them
        would count the partition's events twice (a count rule firing early)."""
        takes = [asyncio.create_task(self._take(p, epoch, t)) for t in (False, True)]
        try:
            await asyncio.gather(*takes)
        except BaseException:
            for take in takes:
                take.cancel()
            await asyncio.gather(*takes, return_exceptions=True)
            raise

    async def _take(self, p: int, epoch: int, telemetry: bool) -> None:
        stream = TELEMETRY if telemetry else EVENTS
        probe = self.make_intake(stream, telemetry, p, durable(telemetry, p, epoch))
        async with self._takeovers:
            done = await self._take_over(p, epoch, telemetry, stream, probe)
        self.names[(telemetry, p)] = done.durable
        self._log_takeover(p, telemetry, done)

    async def _take_over(
        self, p: int, epoch: int, telemetry: bool, stream: str, probe: Intake
    ) -> Takeover:
        return await take_over(
            self.js,
            stream=stream,
            telemetry=telemetry,
            partition=p,
            epoch=epoch,
            config=probe.consumer_config(),
            span_s=self._span(telemetry),
            now=self.clock.now(),
            feed=self.matcher.warm,
            lease_epoch=lambda: self._lease_epoch(p),
            verifier=probe.identity,  # what the intake would have refused is not warmed
            book=probe.facts,  # telemetry v2 joined to its node's static facts, as it was
        )

    def _log_takeover(self, p: int, telemetry: bool, done: Takeover) -> None:
        log.info(
            "partition %d %s: from seq %d, %d events replayed into the windows",
            p,
            "telemetry" if telemetry else "events",
            done.floor + 1,
            done.warmed,
        )

    async def _lease_epoch(self, p: int) -> int | None:
        """The epoch the leases bucket holds for partition `p` now (None: nobody's)."""
        held = (await read_leases(self.kv, self.count)).get(p)
        return held[0].epoch if held is not None else None

    def _span(self, telemetry: bool) -> float:
        """How far back a takeover replays: the longest window of the stream's rules."""
        kinds = self.matcher.kinds()
        if telemetry:
            return min(self.matcher.span_s({"telemetry"} & kinds), TELEMETRY_SPAN_MAX_S)
        return self.matcher.span_s(kinds - {"telemetry"})

    async def _consume(self, p: int, stop: asyncio.Event) -> None:
        intakes = [
            self.make_intake(s, s == TELEMETRY, p, self.names[(s == TELEMETRY, p)])
            for s in (EVENTS, TELEMETRY)
        ]
        watch = asyncio.create_task(self._watch(p, stop))
        try:
            await asyncio.gather(*(self._supervised(i, stop, p) for i in intakes))
        finally:
            watch.cancel()

    async def _watch(self, p: int, stop: asyncio.Event) -> None:
        """Stop fetching the moment the lease runs out here, not at the next round (which
        may wait on KV for long): what this replica fetches after that, the next owner
        decides too, from its own consumer."""
        while not stop.is_set():
            held = self.ownership.held.get(p)
            left = held.valid_until - time.monotonic() if held is not None else 0.0
            if left <= 0:
                stop.set()
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), min(left, 1.0))

    async def _supervised(self, intake: Intake, stop: asyncio.Event, p: int) -> None:
        delay = 0.5
        while not stop.is_set():
            try:
                await intake.run(stop)
                return
            except asyncio.CancelledError:
                raise
            except ConsumerGone as exc:
                # Its consumer is gone (another replica took the partition over): give the
                # lease back, if it is still this replica's, so the partition is taken
                # over afresh rather than left with nobody reading it.
                log.warning("partition %d: %s; giving it back", p, exc)
                stop.set()
                # Held until done (the loop keeps only weak references to tasks), then
                # dropped: an engine whose consumers are taken often must not keep them all.
                release = asyncio.create_task(self.ownership.release(p))
                self._releasing.add(release)
                release.add_done_callback(self._releasing.discard)
                return
            except LeaseLost as exc:  # the fence: this batch stays unacked; go on if held
                log.warning("partition %d: %s; its batch is left to be delivered again", p, exc)
            except Exception as exc:  # NATS away: try again while held
                self.metrics.loop_restarts.labels(intake.durable).inc()
                if away(exc):  # back in a moment: no backoff to sit out after it
                    delay = AWAY_PAUSE_S
                log.warning("%s failed (%s); restarting in %.1fs", intake.durable, exc, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
            delay = min(delay * 2, 10.0)

    async def lose(self, p: int) -> None:
        """Stop deciding for the partition, stop its consumers, forget its state."""
        self.ready.discard(p)
        worker = self.workers.pop(p, None)
        if worker is not None:
            worker.stop.set()
            try:
                await asyncio.wait_for(asyncio.shield(worker.task), STOP_WAIT_S)
            except TimeoutError:
                worker.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await worker.task
            except Exception:  # the loop logged it; the partition is gone anyway
                pass
        nodes = self._nodes.get(p, frozenset())
        self.matcher.forget(nodes)
        if self.facts is not None:  # what KV lacked may be there when the partition is back
            self.facts.forget_misses(nodes)
        self.metrics.partitions_held.set(len(self.ready))


async def check_layout(js: JetStreamContext, count: int) -> None:
    """The streams are split into as many partitions as this replica thinks: a replica set
    to another number would consume some partitions twice and others never."""
    for stream, transform in ((TELEMETRY, telemetry_transform), (EVENTS, events_transform)):
        config = (await js.stream_info(stream)).config
        found = config.subject_transform.dest if config.subject_transform else None
        if found != transform(count).dest:
            raise ConfigError(
                f"stream {stream} maps subjects as {found!r}, not into {count} partitions "
                f"as nats.partitions says: every replica must use the same nats.partitions "
                "(the streams follow the last engine that set them up)"
            )


def filters(telemetry: bool, partition: int) -> str:
    """The stored subjects of one partition of a stream."""
    return telemetry_filter(partition) if telemetry else events_filter(partition)


class ReplicaLock:
    """One process per replica id on a state dir: two engines under one name would take
    each other's leases as their own."""

    def __init__(self, state_dir: Path, replica: str) -> None:
        self.path = state_dir / f"replica-{replica}.lock"
        self._file: IO[str] | None = None

    def __enter__(self) -> ReplicaLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = self.path.open("a")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise ConfigError(
                f"another engine runs as replica {self.path.stem.removeprefix('replica-')} "
                f"on state dir {self.path.parent}: give each replica its own `replica_id` "
                "(GPUOPS_REPLICA_ID) or state dir"
            ) from None
        self._file = handle
        return self

    def __exit__(self, *_: object) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
