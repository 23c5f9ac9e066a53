"""Taking over a partition: rebuild its rule windows from the stream, then consume.

The partition's durable consumer says how far its last owner got: every message at or
below the ack floor was decided (its handling was recorded before the ack). Those of
the last `span` seconds are read again and fed to the matcher without deciding (so a
`for: 60s` 40 s along goes on from 40 s, and a rule that fired stays fired); the
consumer is then made anew to deliver from floor + 1. Making it anew also fences the
last owner out: if it is alive but cut off, its consumer is gone when it comes back,
so it cannot fetch or ack anything of the partition again.

Messages after the floor that the last owner had decided but not acked are decided
again; every decision is idempotent by event id, so that is the first decision again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from gpuops.bus.reader import one_read
from gpuops.errors import EventError
from gpuops.intake.decode import decode
from gpuops.models import Event

log = logging.getLogger(__name__)

Feed = Callable[[Event], None]


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
    durable: str,
    subject: str,
    config: ConsumerConfig,
    span_s: float,
    now: float,
    feed: Feed,
) -> Takeover:
    """Warm the windows from what was decided, then (re)make the durable from floor + 1."""
    floor = await _ack_floor(js, stream, durable)
    warmed = 0
    if floor and span_s > 0:
        warmed = await _warm(js, stream, subject, now - span_s, floor, feed)
    with contextlib.suppress(NotFoundError):
        await js.delete_consumer(stream, durable)
    fresh = ConsumerConfig.from_response(config.as_dict())
    fresh.durable_name = fresh.name = durable
    fresh.filter_subject = subject
    if floor:
        fresh.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
        fresh.opt_start_seq = floor + 1
    await js.add_consumer(stream, fresh)
    return Takeover(stream, durable, floor, warmed)


async def _ack_floor(js: JetStreamContext, stream: str, durable: str) -> int:
    try:
        info = await js.consumer_info(stream, durable)
    except NotFoundError:
        return 0
    return int(info.ack_floor.stream_seq or 0) if info.ack_floor else 0


async def _warm(
    js: JetStreamContext, stream: str, subject: str, since: float, floor: int, feed: Feed
) -> int:
    """Feed the partition's messages stored after `since`, up to the floor."""
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_TIME,
        opt_start_time=datetime.fromtimestamp(since, UTC),
        ack_policy=AckPolicy.NONE,
        filter_subject=subject,
        max_ack_pending=-1,
    )
    fed = 0
    async with one_read(js, subject, stream, config) as sub:
        while True:
            try:
                msgs = await sub.fetch(1024, timeout=2.0)
            except (NatsTimeout, TimeoutError):
                return fed  # nothing more stored
            for msg in msgs:
                meta = msg.metadata
                if meta.sequence.stream > floor:
                    return fed
                with contextlib.suppress(EventError):  # dead-lettered when it came
                    feed(decode(msg.data, msg.subject))
                    fed += 1
                if not meta.num_pending:
                    return fed
