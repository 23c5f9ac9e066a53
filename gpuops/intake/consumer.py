"""Durable pull consumers: fetch, decode, hand to the pipeline, ack only when recorded."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from gpuops import subjects
from gpuops.clock import Clock
from gpuops.errors import EventError
from gpuops.intake.decode import dead_letter, decode
from gpuops.models import Event

log = logging.getLogger(__name__)

Handler = Callable[[Event], Awaitable[None]]


class Intake:
    """One durable consumer on one stream, feeding decoded events to a handler.

    Malformed messages go to `gpuops.dlq.<reason>` with the raw payload and are then
    acked, so a poison message is kept for people and never blocks the stream.
    """

    def __init__(
        self,
        js: JetStreamContext,
        clock: Clock,
        *,
        stream: str,
        subject: str,
        durable: str,
        handler: Handler,
        batch: int = 256,
        ack_all: bool = False,
        max_future_s: float = 300.0,
        on_dead: Callable[[str], None] | None = None,
    ) -> None:
        self.js = js
        self.clock = clock
        self.stream = stream
        self.subject = subject
        self.durable = durable
        self.handler = handler
        self.batch = batch
        self.ack_all = ack_all
        self.max_future_s = max_future_s
        self.on_dead = on_dead
        self.dead: Counter[str] = Counter()

    def consumer_config(self) -> ConsumerConfig:
        """The durable consumer's settings (a takeover makes it with these)."""
        return ConsumerConfig(
            ack_policy=AckPolicy.ALL if self.ack_all else AckPolicy.EXPLICIT,
            # Long enough for a batch handled slowly on a loaded host not to come back;
            # short enough that what a crashed engine held is decided again soon.
            ack_wait=120.0 if self.ack_all else 60.0,
            max_deliver=20,  # a handler bug must not redeliver one event forever
            max_ack_pending=max(1000, self.batch * 4),
            filter_subject=self.subject,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch until `stop` is set."""
        sub = await self.js.pull_subscribe(
            self.subject, durable=self.durable, stream=self.stream, config=self.consumer_config()
        )
        while not stop.is_set():
            try:
                msgs = await sub.fetch(self.batch, timeout=0.5)
            except (NatsTimeout, TimeoutError):
                continue
            except NatsError as exc:  # a reconnect in progress: wait, the consumer is durable
                log.warning("fetch from %s failed (%s); retrying", self.durable, exc)
                await asyncio.sleep(1.0)
                continue
            await self.process(msgs)

    async def process(self, msgs: list[Msg]) -> None:
        """Handle a batch in order; each message is acked after its handling is recorded."""
        for msg in msgs:
            try:
                event = self._decode(msg)
            except EventError as exc:
                await self._dead_letter(msg, exc)
                if not self.ack_all:
                    await msg.ack()
                continue
            try:
                await self.handler(event)
            except Exception:
                log.exception("handling %s %s failed; it will be redelivered", event.kind, event.id)
                if not self.ack_all:
                    await msg.nak(delay=5)
                continue
            if not self.ack_all:
                await msg.ack()
        if self.ack_all and msgs:
            await msgs[-1].ack()

    def _decode(self, msg: Msg) -> Event:
        return decode(msg.data, msg.subject, now=self.clock.now(), max_future_s=self.max_future_s)

    async def _dead_letter(self, msg: Msg, exc: EventError) -> None:
        self.dead[exc.reason] += 1
        if self.on_dead is not None:
            self.on_dead(exc.reason)
        log.warning("dead letter (%s) from %s: %s", exc.reason, msg.subject, exc.message)
        body = dead_letter(exc.reason, exc.message, msg.data, msg.subject, self.clock.now())
        seq = msg.metadata.sequence.stream
        await self.js.publish(
            subjects.dlq(exc.reason), body, headers={"Nats-Msg-Id": f"dlq-{self.stream}-{seq}"}
        )
