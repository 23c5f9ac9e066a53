"""Durable pull consumers: fetch, decode, hand to the pipeline, ack only when recorded."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import NotFoundError

from gpuops import subjects
from gpuops.bus import durable
from gpuops.bus.identity import PUBLISHER, Verifier
from gpuops.clock import Clock
from gpuops.errors import BusError, ConsumerGone, EventError, LeaseLost
from gpuops.intake.compact import FactsBook, FactsUnknown
from gpuops.intake.decode import MAX_FUTURE_S, dead_letter, decode_intake
from gpuops.intake.fetch import Puller, ack, nak
from gpuops.match.facts import Telemetry
from gpuops.models import Event

log = logging.getLogger(__name__)

Handler = Callable[[Event | Telemetry], Awaitable[object]]  # what it returns is not the intake's

EXPIRES_S = 0.5  # a pull waits this long for a first message before asking again
# Telemetry gives the loop back this often, so a health event that came in is read and
# decided within a slice or two rather than after a whole batch.
SLICE_S = 0.001
# A health event whose handling failed is redelivered this many times in all, each after
# a pause: a handler bug must not redeliver one event forever.
MAX_DELIVER = 20
REDELIVER_S = 5.0


class Priority:
    """Health events first: while one intake handles a batch, the others pause between
    slices of theirs (the decision's KV round trips then never wait behind samples)."""

    def __init__(self) -> None:
        self._holding = 0
        self._free = asyncio.Event()
        self._free.set()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Others wait while this block runs."""
        self._holding += 1
        self._free.clear()
        try:
            yield
        finally:
            self._holding -= 1
            if not self._holding:
                self._free.set()

    async def turn(self) -> None:
        """Give the loop a turn, then wait while a holder works."""
        await asyncio.sleep(0)
        await self._free.wait()


def until_tick(now: float, every: float) -> float:
    """Seconds from `now` to the next multiple of `every` (a whole `every` on one): the
    same instant for every caller on the same clock."""
    return every - now % every


class Intake:
    """One durable consumer on one stream, feeding decoded events to a handler.

    Malformed messages go to `gpuops.dlq.<reason>` with the raw payload and are then
    acked, so a poison message is kept for people and never blocks the stream. With a
    `priority`, an `urgent` intake holds it while it handles a batch; any other yields
    to it every `SLICE_S` of handling. With `linger_s`, a batch that was not full is
    followed by a pause until the loop clock's next multiple of it before the next pull
    (what comes meanwhile waits in the stream).
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
        linger_s: float = 0.0,
        ack_all: bool = False,
        max_future_s: float = 300.0,
        on_dead: Callable[[str], None] | None = None,
        on_batch: Callable[[int, float], None] | None = None,
        priority: Priority | None = None,
        urgent: bool = False,
        create: bool = True,
        identity: Verifier | None = None,
        facts: FactsBook | None = None,
        max_deliver: int = MAX_DELIVER,
        redeliver_s: float = REDELIVER_S,
    ) -> None:
        self.js = js
        self.nc: Client = js._nc  # the context's connection: acks and pulls go on it
        self.clock = clock
        self.stream = stream
        self.subject = subject
        self.durable = durable
        self.handler = handler
        self.batch = batch
        self.linger_s = linger_s
        self.ack_all = ack_all
        self.max_future_s = max_future_s
        self.on_dead = on_dead
        # Told the size of every pull that brought messages and the seconds its handling
        # took (the loop's clock: what other tasks did while it waited counts too).
        self.on_batch = on_batch
        self.priority = priority
        self.urgent = urgent
        # A partition's consumer is made by its takeover only: one found missing was
        # taken over by another replica, and making it again would read twice.
        self.create = create
        # Every message's publisher is checked before its payload is read (None: the
        # shadow's and the tests' intakes, whose messages were checked when they came).
        self.identity = identity
        # Telemetry v2's static facts per node, shared by an engine's intakes (None:
        # v2 samples are refused as `schema`).
        self.facts = facts
        self.max_deliver = max_deliver
        self.redeliver_s = redeliver_s
        self.dead: Counter[str] = Counter()
        # What a batch left unhandled when its handling raised (the failing message
        # first): the loop starts again on the same consumer, which does not deliver
        # them again before ack_wait, and with AckAll the next batch's ack would cover
        # them. So they are handled first when it does (their acks are still good).
        self._held: list[Msg] = []

    def consumer_config(self) -> ConsumerConfig:
        """The durable consumer's settings (a takeover makes it with these)."""
        return ConsumerConfig(
            ack_policy=AckPolicy.ALL if self.ack_all else AckPolicy.EXPLICIT,
            # Long enough for a batch handled slowly on a loaded host not to come back;
            # short enough that what a crashed engine held is decided again soon.
            ack_wait=120.0 if self.ack_all else 60.0,
            max_deliver=self.max_deliver,
            max_ack_pending=max(1000, self.batch * 4),
            filter_subject=self.subject,
        )

    async def run(self, stop: asyncio.Event) -> None:
        """Fetch until `stop` is set; a consumer deleted or moved is made again."""
        puller = Puller(self.nc, self.stream, self.durable, self.js._prefix)
        try:
            while not stop.is_set():
                await self._ensure_consumer()
                await self._pull(puller, stop)
        finally:
            await puller.stop()

    async def _ensure_consumer(self) -> None:
        """Create the durable consumer when it is missing (as `pull_subscribe` did), and
        put it back as made when it was changed (gpuops.bus.durable)."""
        want = self.consumer_config()
        want.durable_name = self.durable
        try:
            info = await self.js.consumer_info(self.stream, self.durable)
        except NotFoundError:
            if not self.create:
                raise ConsumerGone(f"consumer {self.durable} is gone: taken over") from None
            await self.js.add_consumer(self.stream, want)
            return
        # Where it starts is the takeover's (from the last owner's floor), not compared.
        want.deliver_policy = None
        await durable.keep(self.js, self.stream, info, want)

    async def _pull(self, puller: Puller, stop: asyncio.Event) -> None:
        # With AckAll, a batch's ack goes out with the next pull request, in the same
        # write: a write to the server costs about as much as handling a sample, and a
        # lingering intake would otherwise make two a pull. The ack waits at most a linger
        # (what a crash meanwhile redelivers was decided already; its intents are stored
        # once by their keys), and leaving sends it.
        done: Msg | None = None
        try:
            while not stop.is_set():
                if done is not None:
                    await ack(self.nc, done)
                    done = None
                if self._held:  # left by a batch whose handling raised: handled first
                    msgs, self._held = self._held, []
                else:
                    try:
                        msgs = await puller.fetch(self.batch, EXPIRES_S)
                    except BusError as exc:
                        log.warning("%s; creating the consumer again", exc)
                        return
                    except NatsError as exc:  # a reconnect in progress: the consumer is durable
                        log.warning("fetch from %s failed (%s); retrying", self.durable, exc)
                        await asyncio.sleep(1.0)
                        continue
                if msgs:
                    busy_s = await self.process(msgs)
                    done = msgs[-1] if self.ack_all else None
                    if self.on_batch is not None:
                        self.on_batch(len(msgs), busy_s)
                if msgs and len(msgs) < self.batch and self.linger_s > 0:
                    await self._linger(stop)
        finally:
            if done is not None:
                with contextlib.suppress(NatsError, OSError):
                    await ack(self.nc, done)

    async def _linger(self, stop: asyncio.Event) -> None:
        """Wait for the loop clock's next multiple of the linger (or `stop`): every
        lingering intake of the engine wakes at the same turn of the loop, so their acks
        and pull requests go to the server in one write and come back together."""
        wait_s = until_tick(asyncio.get_running_loop().time(), self.linger_s)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):  # no task, as wait_for makes one
                await stop.wait()

    async def process(self, msgs: list[Msg]) -> float:
        """Handle a batch in order; each message is acked after its handling is recorded
        (with AckAll, the batch's last one by the pull loop, after the whole batch).
        Returns the seconds the messages' handling took (the turns given to others left
        out; a handling that waits on a round trip counts what ran meanwhile)."""
        if self.priority is not None and self.urgent:
            with self.priority.held():
                return await self._process(msgs)
        return await self._process(msgs)

    async def _process(self, msgs: list[Msg]) -> float:
        # The loop's clock, read once a message for the slice anyway, also times the
        # handling (process CPU time is a system call each read).
        began = time.perf_counter()
        yield_at, busy_s = began + SLICE_S, 0.0
        pause = None if self.urgent else self.priority
        for i, msg in enumerate(msgs):
            try:
                await self._one(msg)
            except BaseException:
                self._held = msgs[i:]
                raise
            if pause is not None and (now := time.perf_counter()) >= yield_at:
                busy_s += now - began
                await pause.turn()
                began = time.perf_counter()
                yield_at = began + SLICE_S
        return busy_s + time.perf_counter() - began

    async def _one(self, msg: Msg) -> None:
        try:
            event = await self._read(msg)
        except EventError as exc:
            await self._refuse(msg, exc)
            return
        except (BusError, NatsError, OSError):
            raise  # the bus, not the message: it comes again
        except Exception as exc:
            # A decoder's fault on this message (every refusal it knows is an EventError).
            # Raised on, the intake would restart and the message come back for ever,
            # holding up its partition: it goes to the dead letters with the error.
            log.exception("decoding a message from %s failed", msg.subject)
            why = f"decoding failed: {type(exc).__name__}: {exc}"
            await self._refuse(msg, EventError("undecodable", why))
            return
        try:
            await self.handler(event)
        except LeaseLost:
            raise  # the partition went to another replica: nothing more is handled or acked
        except Exception as exc:
            if not self.ack_all and not self._last_delivery(msg):
                log.exception("handling %s %s failed; it will be redelivered", event.kind, event.id)
                await nak(self.nc, msg, self.redeliver_s)
                return
            await self._undecided(msg, event, exc)
            return
        if not self.ack_all:
            await ack(self.nc, msg)

    def _last_delivery(self, msg: Msg) -> bool:
        """Whether the server delivers this message no more (max_deliver reached)."""
        return 0 < self.max_deliver <= msg.metadata.num_delivered

    async def _undecided(self, msg: Msg, event: Event | Telemetry, exc: Exception) -> None:
        """A message whose handling failed and that is not delivered again goes to the dead
        letters with its error, counted, so nothing published is dropped unseen: a
        telemetry sample (the batch's ack, AckAll, covers it; its node's next sample is
        decided afresh), or a health event on its last delivery (NAK'd, it would never come
        back, and once later events are acked the floor would pass it, so the next
        takeover would replay it into the windows as if it had been decided)."""
        log.exception("handling %s %s failed; dead-lettered as undecided", event.kind, event.id)
        try:
            await self._dead_letter(msg, EventError("undecided", f"handling failed: {exc}"))
        except (NatsError, OSError) as gone:  # the bus may be what failed
            if not self.ack_all:
                raise  # unacked and held (self._held): tried again when the intake restarts
            log.error("%s %s not dead-lettered either: %s", event.kind, event.id, gone)
            return
        if not self.ack_all:
            await ack(self.nc, msg)

    async def _refuse(self, msg: Msg, exc: EventError) -> None:
        await self._dead_letter(msg, exc)
        if not self.ack_all:
            await ack(self.nc, msg)

    async def _read(self, msg: Msg) -> Event | Telemetry:
        """The message decoded; a v2 sample whose node's static facts another replica
        learnt is decoded again once they are read from KV, and facts learnt here are
        in KV before the sample is handled (a takeover then finds them)."""
        event = await read_stored(
            msg,
            self.identity,
            self.facts,
            now=self.clock.now(),
            max_future_s=self.max_future_s,
        )
        if self.facts is not None and self.facts.unsaved(event.node):
            try:
                await self.facts.save(event.node)
            except (BusError, NatsError, OSError) as exc:
                log.warning(
                    "static facts of %s not written to KV (%s); kept for its next sample",
                    event.node,
                    exc,
                )
        return event

    async def _dead_letter(self, msg: Msg, exc: EventError) -> None:
        log.warning("dead letter (%s) from %s: %s", exc.reason, msg.subject, exc.message)
        claimed = (msg.headers or {}).get(PUBLISHER, "")
        body = dead_letter(
            exc.reason, exc.message, msg.data, msg.subject, self.clock.now(), claimed
        )
        seq = msg.metadata.sequence.stream
        await self.js.publish(
            subjects.dlq(exc.reason), body, headers={"Nats-Msg-Id": f"dlq-{self.stream}-{seq}"}
        )
        # Counted once stored: a publish that failed is tried again with the message.
        self.dead[exc.reason] += 1
        if self.on_dead is not None:
            self.on_dead(exc.reason)


async def read_stored(
    msg: Msg,
    verifier: Verifier | None,
    book: FactsBook | None,
    now: float | None = None,
    max_future_s: float = MAX_FUTURE_S,
) -> Event | Telemetry:
    """A stream's message decoded as the intake reads it (a takeover's warm-up reads the
    decided ones so too): a v2 sample whose node's static facts another replica learnt
    is decoded again once they are read from KV; EventError when it is refused, or when
    KV lacks the facts too."""

    def decoded() -> Event | Telemetry:
        return decode_intake(
            msg.data,
            msg.subject,
            now=now,
            max_future_s=max_future_s,
            headers=msg.headers,
            verifier=verifier,
            book=book,
        )

    try:
        return decoded()
    except FactsUnknown as exc:
        if book is None or not await _loaded(book, exc):
            raise
        return decoded()


async def _loaded(book: FactsBook, missing: FactsUnknown) -> bool:
    try:
        return await book.load(missing.node, missing.facts, missing.at)
    except (BusError, NatsError, OSError) as exc:
        log.warning("static facts of %s not read from KV (%s)", missing.node, exc)
        return False
