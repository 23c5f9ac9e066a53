"""Pull batches from a durable JetStream consumer without a future per message.

nats-py's `fetch` waits on each message of a batch with its own timer and future. Here
one inbox subscription takes every delivery: its callback appends the raw message to
the open batch, and the batch ends on the server's word (the batch count reached, 404
"no messages" once what was pending is delivered, or 408 when the request expires).
The request asks `no_wait` with `expires`: the server holds it until a message comes,
then answers as soon as nothing more is pending, so a lone health event is handed over
at once rather than when the request expires.

Acks go straight to the reply subject (`+ACK`; with AckAll the batch's last one).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from gpuops.errors import BusError

log = logging.getLogger(__name__)

# A request's messages are at most `batch`, each under the server's max payload (1 MiB
# by default): limits this high mean the client never drops one as a slow consumer.
MAX_MSG_BYTES = 1 << 20
EXPIRES_MARGIN_S = 2.0  # after `expires`, how long to wait for the server's 408


class PullError(BusError):
    """The consumer cannot serve pulls now (deleted, leader changed): create it again."""


class Puller:
    """Batches from `$JS.API.CONSUMER.MSG.NEXT.<stream>.<durable>` on one inbox."""

    def __init__(self, nc: Client, stream: str, durable: str, api_prefix: str = "$JS.API") -> None:
        self.nc = nc
        self.stream, self.durable = stream, durable
        self.next_subject = f"{api_prefix}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._inbox = ""
        self._sub: Subscription | None = None
        self._request = 0
        self._batch: list[Msg] = []
        self._want = 0
        # The open request's end: a future per request (cheaper than an Event's wait).
        self._done: asyncio.Future[None] | None = None
        self._failed: str | None = None

    async def start(self, batch: int) -> None:
        """Subscribe the inbox (once; nats-py subscribes it again after a reconnect)."""
        self._inbox = self.nc.new_inbox()
        room = 4 * batch + 16
        self._sub = await self.nc.subscribe(
            f"{self._inbox}.*",
            cb=self._deliver,
            pending_msgs_limit=room,
            pending_bytes_limit=room * MAX_MSG_BYTES,
        )

    async def stop(self) -> None:
        """Unsubscribe (messages delivered and not acked come back after ack_wait)."""
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def fetch(self, batch: int, expires_s: float) -> list[Msg]:
        """Up to `batch` messages: those pending now, else the first to come within
        `expires_s` and any right behind it; [] when none came."""
        if self._sub is None:
            await self.start(batch)
        if self._batch:  # came after an earlier request ended (a reconnect): theirs first
            early, self._batch = self._batch, []
            return early
        self._request += 1
        self._batch, self._want, self._failed = [], batch, None
        done = self._done = asyncio.get_running_loop().create_future()
        await self.nc.publish(
            self.next_subject, _request(batch, expires_s), reply=f"{self._inbox}.{self._request}"
        )
        # asyncio.timeout, not wait_for: no task per pull (a telemetry intake pulls
        # several times a second per partition).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(expires_s + EXPIRES_MARGIN_S):
                await done
        self._want, self._done = 0, None
        if self._failed is not None:
            # What the request brought before the status stays for the next fetch: acked
            # past with AckAll (a later message's ack), it would be lost unhandled.
            raise PullError(f"pull from {self.stream}/{self.durable}: {self._failed}")
        batch_out, self._batch = self._batch, []
        return batch_out

    def _end(self) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    async def _deliver(self, msg: Msg) -> None:
        """The inbox's callback: a message joins the batch; a status may end it."""
        if msg.reply:  # a stream message (status messages carry no reply subject)
            self._batch.append(msg)
            if len(self._batch) >= self._want:
                self._end()
            return
        code = (msg.headers or {}).get("Status", "")
        if code == "100" or not msg.subject.endswith(f".{self._request}"):
            return  # a heartbeat, or the end of an earlier request
        if code not in ("404", "408"):
            why = (msg.headers or {}).get("Description", "")
            self._failed = f"{code} {why}".strip()
        self._end()


@functools.lru_cache(maxsize=16)
def _request(batch: int, expires_s: float) -> bytes:
    """A pull request's body (an intake asks the same every time)."""
    return json.dumps({"batch": batch, "expires": int(expires_s * 1e9), "no_wait": True}).encode()


async def ack(nc: Client, msg: Msg) -> None:
    """Acknowledge one message (AckAll: it and every one before it)."""
    await nc.publish(msg.reply, b"+ACK")


async def nak(nc: Client, msg: Msg, delay_s: float) -> None:
    """Ask for the message again after `delay_s`."""
    await nc.publish(msg.reply, b"-NAK " + json.dumps({"delay": int(delay_s * 1e9)}).encode())
