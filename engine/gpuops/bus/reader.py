"""Reading a stream once, through a consumer of the read's own that is gone after it.

An ephemeral consumer that is only unsubscribed lives on the server until its inactive
threshold; the server refuses a stream's thousandth consumer, so a page read every
second (a console, a status poll) would fill the stream with idle consumers within
minutes and then every reader, the engine's included, would be refused. The consumer
of a read is deleted when the read ends, however it ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig
from nats.js.errors import Error as JsError

# Left to itself (a reader killed mid-read), the consumer goes after this long.
ABANDONED_AFTER_S = 30.0


@asynccontextmanager
async def one_read(
    js: JetStreamContext, subject: str, stream: str, config: ConsumerConfig
) -> AsyncIterator[JetStreamContext.PullSubscription]:
    """A pull subscription for one read of `stream`; its consumer is deleted after."""
    if config.inactive_threshold is None:
        config.inactive_threshold = ABANDONED_AFTER_S
    sub = await js.pull_subscribe(subject, stream=stream, config=config)
    try:
        yield sub
    finally:
        with contextlib.suppress(NatsError, JsError, TimeoutError, ValueError):
            name = (await sub.consumer_info()).name
            await sub.unsubscribe()
            await js.delete_consumer(stream, name)
