"""Taking over a partition: rebuild its rule windows from the stream, then consume.

The partition's durable consumer says how far its last owner got: every message at or
below the ack floor was decided (its handling was recorded before the ack). Those of
the last `span` seconds are read again and fed to the matcher without deciding (so a
`for: 60s` 40 s along goes on from 40 s, and a rule that fired stays fired); a consumer
named by the new owner's epoch is then made to deliver from floor + 1, and the old ones
are deleted. That fences the last owner out: if it is alive but cut off, its consumer
is gone when it comes back, it cannot make it again (a partition's intake never
creates its consumer) and it does not know the new one's name. A takeover cut short
between making the new consumer and deleting the old leaves both: the next one takes
the highest floor of all and deletes them all.

Messages after the floor that the last owner had decided but not acked are decided
again; every decision is idempotent by event id, so that is the first decision again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, ConsumerInfo, DeliverPolicy
from nats.js.errors import NotFoundError

from gpuops.bus.identity import Verifier
from gpuops.bus.partitions import durable, epoch_of
from gpuops.bus.reader import one_read
from gpuops.errors import EventError, LeaseLost
from gpuops.intake.compact import FactsBook
from gpuops.intake.consumer import read_stored
from gpuops.match.facts import Telemetry
from gpuops.models import Event

log = logging.getLogger(__name__)

Feed = Callable[[Event | Telemetry], None]

# Reads of a stream's consumers while takeovers delete some under it: each one that
# finds a deleted consumer is followed by the takeover's own, already made.
SNAPSHOT_READS = 5
# A warm-up's fetch that brings nothing while its consumer still has messages pending is
# NATS stalled (a host overloaded, a blip), not the end of what was decided: asked this
# many times in all, then TimeoutError (the takeover is started again while its lease
# holds) rather than windows left with part of what was decided.
WARM_FETCH_S = 2.0
WARM_FETCH_TRIES = 3


@dataclass(frozen=True, slots=True)
class Takeover:
    """What a takeover found and did, for the log and the metrics."""

    stream: str
    durable: str
    floor: int  # the last message the previous owner had finished (0: none)
    warmed: int  # messages fed to the windows again


async def take_over(
    js: JetStreamContext,
    *,
    stream: str,
    telemetry: bool,
    partition: int,
    epoch: int,
    config: ConsumerConfig,
    span_s: float,
    now: float,
    feed: Feed,
    lease_epoch: Callable[[], Awaitable[int | None]],
    verifier: Verifier | None = None,
    book: FactsBook | None = None,
) -> Takeover:
    """Warm the windows from what was decided, then make this epoch's durable from
    floor + 1 and delete the earlier owners'.

    A consumer named by a later epoch is a later owner's only if the leases bucket says
    that owner holds the partition (`lease_epoch`, read now): a name alone is anyone's
    to make, and believing it would stop this partition for good. One the lease does
    not back is deleted, and its floor is not taken. Only durables are owners' (readers
    may make ephemeral consumers only, and could name one as an owner's): any other
    consumer of the partition's name is deleted unread, and no floor is believed past
    the stream's last message.
    """
    subject = config.filter_subject or ""
    found = await partition_consumers(js, stream, telemetry, partition)
    earlier = {n: i for n, i in found.items() if i.config.durable_name == n}
    for impostor in sorted(set(found) - set(earlier)):
        log.warning(
            "partition %d: consumer %s is not durable: not an owner's; deleting it",
            partition,
            impostor,
        )
        with contextlib.suppress(NotFoundError):
            await js.delete_consumer(stream, impostor)
    newer = [n for n in earlier if (epoch_of(n, telemetry, partition) or 0) > epoch]
    if newer:
        leased = await lease_epoch()
        if leased is None or leased > epoch:  # a later owner took it: this one is stale
            raise LeaseLost(f"partition {partition} was taken over again ({newer[0]})")
        log.warning(
            "partition %d: consumer(s) %s name an epoch after %d, which the lease holds: "
            "not an owner's; deleting them",
            partition,
            ", ".join(newer),
            epoch,
        )
    floor = max((_floor(i) for n, i in earlier.items() if n not in newer), default=0)
    floor = min(floor, (await js.stream_info(stream)).state.last_seq or 0)
    warmed = 0
    if floor and span_s > 0:
        warmed = await _warm(js, stream, subject, now - span_s, floor, feed, verifier, book)
    name = durable(telemetry, partition, epoch)
    fresh = ConsumerConfig.from_response(config.as_dict())
    fresh.durable_name = fresh.name = name
    if floor:
        fresh.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
        fresh.opt_start_seq = floor + 1
    if name not in earlier:
        await js.add_consumer(stream, fresh)
    for old in earlier:
        if old != name:
            with contextlib.suppress(NotFoundError):
                await js.delete_consumer(stream, old)
    return Takeover(stream, name, floor, warmed)


async def partition_consumers(
    js: JetStreamContext, stream: str, telemetry: bool, partition: int
) -> dict[str, ConsumerInfo]:
    """The consumers of one partition of a stream (any epoch), by name."""
    infos, whole = await _snapshot(
        js, stream, lambda n: epoch_of(n, telemetry, partition) is not None
    )
    if not whole:  # a floor from part of them could replay what was decided
        raise LeaseLost(f"partition {partition}'s consumers kept changing under the takeover")
    return {info.name or "": info for info in infos}


async def all_consumers(js: JetStreamContext, stream: str) -> list[ConsumerInfo]:
    """Every consumer of a stream (should takeovers keep deleting some while it is read,
    those deleted are left out: their partitions read as not drained)."""
    return (await _snapshot(js, stream, lambda _: True))[0]


async def _snapshot(
    js: JetStreamContext, stream: str, wanted: Callable[[str], bool]
) -> tuple[list[ConsumerInfo], bool]:
    """The wanted consumers' states, read again while one listed is gone when asked;
    whether the last read had every one it listed.

    A consumer deleted between the names and its state is a takeover in flight, which
    made its own consumer first: read once more and that one is listed. Read only once,
    the partition would look as if it had no consumer at all (nothing decided, or a
    takeover from the stream's start), though its new owner's consumer is there.
    """
    infos: list[ConsumerInfo] = []
    for _ in range(SNAPSHOT_READS):
        names = [n for n in await consumer_names(js, stream) if wanted(n)]
        infos = await consumer_infos(js, stream, names)
        if len(infos) == len(names):
            return infos, True
    return infos, False


async def consumer_names(js: JetStreamContext, stream: str) -> list[str]:
    """The names of a stream's consumers, 1,024 a page.

    Names, not the server's consumer list: on a cluster the list gathers every consumer's
    state from its leader and, when one is deleted meanwhile (a takeover elsewhere),
    answers only after a 4 s timeout. The names come from the cluster's metadata at once.
    """
    found: list[str] = []
    while True:
        body = json.dumps({"offset": len(found)}).encode()
        # The client has no call for this API; its request helper maps the errors.
        page = await js._api_request(f"{js._prefix}.CONSUMER.NAMES.{stream}", body, timeout=10)
        names = page.get("consumers") or []
        found += names
        if not names or len(found) >= int(page.get("total") or 0):
            return found


async def consumer_infos(js: JetStreamContext, stream: str, names: list[str]) -> list[ConsumerInfo]:
    """The state of the named consumers, asked together; one deleted meanwhile is left out."""

    async def one(name: str) -> ConsumerInfo | None:
        try:
            info: ConsumerInfo = await js.consumer_info(stream, name)
        except NotFoundError:
            return None
        return info

    return [info for info in await asyncio.gather(*(one(n) for n in names)) if info is not None]


def _floor(info: ConsumerInfo) -> int:
    return int(info.ack_floor.stream_seq or 0) if info.ack_floor else 0


async def _warm(
    js: JetStreamContext,
    stream: str,
    subject: str,
    since: float,
    floor: int,
    feed: Feed,
    verifier: Verifier | None = None,
    book: FactsBook | None = None,
) -> int:
    """Feed the partition's messages stored after `since`, up to the floor: those the
    intake took (a forged one was dead-lettered, and must not move a window now), read
    as the intake reads them: telemetry v2 joined to its node's static facts in `book`
    (learnt from the keyframes read again, else from KV). Every one of them, or
    TimeoutError: a read cut short would leave the windows short of what was decided."""
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_TIME,
        opt_start_time=datetime.fromtimestamp(since, UTC),
        ack_policy=AckPolicy.NONE,
        filter_subject=subject,
        max_ack_pending=-1,
    )
    fed, pending = 0, None
    async with one_read(js, subject, stream, config) as sub:
        while msgs := await _more(sub, pending):
            for msg in msgs:
                meta = msg.metadata
                if meta.sequence.stream > floor:
                    return fed
                with contextlib.suppress(EventError):  # dead-lettered when it came
                    feed(await read_stored(msg, verifier, book))
                    fed += 1
                pending = meta.num_pending
                if not pending:
                    return fed
    return fed


async def _more(sub: JetStreamContext.PullSubscription, pending: int | None) -> list[Msg]:
    """The read's next messages; [] only when none are pending after the last one read.

    `pending`: how many the last message read said were left (None before the first:
    then the read's consumer is asked). A fetch that brings nothing (it timed out, or its
    expired pull was answered with a status alone) while some are left is a stall. The
    read acks nothing, so what the server sent a pull nobody waits for anymore is gone
    from it: after a few tries the warm-up raises TimeoutError, and the takeover is
    started again on a new read."""
    for _ in range(WARM_FETCH_TRIES):
        msgs: list[Msg] = []
        with contextlib.suppress(NatsTimeout, TimeoutError):
            msgs = await sub.fetch(1024, timeout=WARM_FETCH_S)
        if msgs:
            return msgs
        left = pending if pending is not None else (await sub.consumer_info()).num_pending
        if not left:
            return []  # nothing stored after the last read (or nothing since `since`)
    raise TimeoutError(
        f"warming the windows stalled: {WARM_FETCH_TRIES} fetches of {WARM_FETCH_S:.0f} s "
        "brought nothing while messages were pending"
    )
