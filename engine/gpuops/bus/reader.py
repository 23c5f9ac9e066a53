"""Reading a stream once, through a consumer of the read's own that is gone after it.

An ephemeral consumer that is only unsubscribed lives on the server until its inactive
threshold; the server refuses a stream's thousandth consumer, so a page read every
second (a console, a status poll) with a long threshold would fill the stream with idle
consumers and then every reader, the engine's included, would be refused. A read's
consumer goes `ABANDONED_AFTER_S` after its last pull. It is not deleted by the reader:
readers may not delete consumers (bus/auth.py), or one could delete the engine's.

On the streams the engine's partitions consume (events, telemetry) a reader may make no
consumer of a name it picks: the engine's are named by partition and epoch, anyone may
list them, and a create request that names one changes it (its filter, its redeliveries)
in place. NATS permissions match whole subject tokens, so "names starting cli-" cannot be
granted; a reader there takes one of a few fixed names of its own (`READER_SLOTS`), which
is all its permissions allow, and deletes it after the read.
"""

from __future__ import annotations

import contextlib
import json
import random
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import APIError
from nats.js.errors import Error as JsError

from gpuops.errors import BusError

# A read's consumer goes this long after its last pull (a page a second: ~10 alive).
ABANDONED_AFTER_S = 10.0
# The names a reader's consumers may have on a stream the engine consumes: as many reads
# of one stream at once (exports), each name freed when its read ends, or by the server
# SLOT_ABANDONED_AFTER_S after a reader that died. Longer than a read's: an export that
# merges two streams leaves one unread while it writes the other's messages (hours of
# telemetry between two event batches), and a slot gone under it ended the export.
READER_SLOTS = tuple(f"gpuops-reader-{k}" for k in range(4))
SLOT_ABANDONED_AFTER_S = 300.0
# The server's answers to a create that may not replace a consumer of that name.
_TAKEN = {10148, 10013, 10105}


@asynccontextmanager
async def one_read(
    js: JetStreamContext, subject: str, stream: str, config: ConsumerConfig
) -> AsyncIterator[JetStreamContext.PullSubscription]:
    """A pull subscription for one read of `stream`; its consumer goes soon after.

    A read acks nothing (AckPolicy.NONE): the server keeps an inactive consumer that
    still has unacked messages whatever its threshold, so a read that left one would
    leave its consumer for good."""
    # Made unnamed (the server names it, at random): on the streams this is for, no
    # durable of another role's is there to be named, and the subject that lets the
    # server name it refuses a durable one (bus/auth.py).
    info = await js.add_consumer(stream, _a_read(config, subject))
    async with _bound(js, stream, info.name) as sub:
        yield sub


@asynccontextmanager
async def _bound(
    js: JetStreamContext, stream: str, name: str
) -> AsyncIterator[JetStreamContext.PullSubscription]:
    """A pull subscription to consumer `name`, unsubscribed when the read ends."""
    sub = await js.pull_subscribe_bind(consumer=name, stream=stream)
    try:
        yield sub
    finally:
        with contextlib.suppress(NatsError, JsError, TimeoutError, ValueError):
            await sub.unsubscribe()


def _a_read(config: ConsumerConfig, subject: str) -> ConsumerConfig:
    """`config` as a read's: unacked, gone soon after its last pull, filtered."""
    if config.inactive_threshold is None:
        config.inactive_threshold = ABANDONED_AFTER_S
    config.ack_policy = AckPolicy.NONE
    if not config.filter_subjects:
        config.filter_subject = subject
    return config


@asynccontextmanager
async def slot_read(
    js: JetStreamContext, subject: str, stream: str, config: ConsumerConfig
) -> AsyncIterator[JetStreamContext.PullSubscription]:
    """`one_read` on a stream the engine consumes: through a consumer named by a free
    one of `READER_SLOTS`, deleted when the read ends; a BusError when none is free."""
    if config.inactive_threshold is None:
        config.inactive_threshold = SLOT_ABANDONED_AFTER_S
    for name in random.sample(READER_SLOTS, len(READER_SLOTS)):
        if not await _take(js, stream, name, _a_read(config, subject)):
            continue
        try:
            async with _bound(js, stream, name) as sub:
                yield sub
        finally:
            with contextlib.suppress(NatsError, JsError, TimeoutError):
                await js.delete_consumer(stream, name)
        return
    raise BusError(
        f"all {len(READER_SLOTS)} reader consumers of {stream} are in use by other reads "
        f"(or by reads that died, for {SLOT_ABANDONED_AFTER_S:g} s): try again shortly"
    )


async def _take(js: JetStreamContext, stream: str, name: str, config: ConsumerConfig) -> bool:
    """Make consumer `name` if no one has it: False when another read holds it.

    `action: create` makes the server refuse a name in use rather than update it, and a
    random description keeps two reads' configs apart (an identical one is not refused:
    the two reads would share the consumer, each getting half of the messages)."""
    config.name, config.description = name, f"gpuops read {secrets.token_hex(8)}"
    body = {"stream_name": stream, "config": config.as_dict(), "action": "create"}
    try:
        await js._api_request(
            f"{js._prefix}.CONSUMER.CREATE.{stream}.{name}", json.dumps(body).encode(), js._timeout
        )
    except APIError as exc:
        if exc.err_code in _TAKEN:
            return False
        raise
    return True
