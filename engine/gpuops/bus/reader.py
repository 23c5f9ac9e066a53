"""Reading a stream once, through a consumer of the read's own that is gone after it.

An ephemeral consumer that is only unsubscribed lives on the server until its inactive
threshold; the server refuses a stream's thousandth consumer, so a page read every
second (a console, a status poll) with a long threshold would fill the stream with idle
consumers and then every reader, the engine's included, would be refused. A read's
consumer goes `ABANDONED_AFTER_S` after its last pull. It is not deleted by the reader:
readers may not delete consumers (bus/auth.py), or one could delete the engine's.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import Error as JsError

# A read's consumer goes this long after its last pull (a page a second: ~10 alive).
ABANDONED_AFTER_S = 10.0


@asynccontextmanager
async def one_read(
    js: JetStreamContext, subject: str, stream: str, config: ConsumerConfig
) -> AsyncIterator[JetStreamContext.PullSubscription]:
    """A pull subscription for one read of `stream`; its consumer goes soon after.

    A read acks nothing (AckPolicy.NONE): the server keeps an inactive consumer that
    still has unacked messages whatever its threshold, so a read that left one would
    leave its consumer for good."""
    if config.inactive_threshold is None:
        config.inactive_threshold = ABANDONED_AFTER_S
    config.ack_policy = AckPolicy.NONE
    if not config.filter_subjects:
        config.filter_subject = subject
    # Made unnamed (the server names it): readers may make no named or durable consumer.
    info = await js.add_consumer(stream, config)
    sub = await js.pull_subscribe_bind(consumer=info.name, stream=stream)
    try:
        yield sub
    finally:
        with contextlib.suppress(NatsError, JsError, TimeoutError, ValueError):
            await sub.unsubscribe()
