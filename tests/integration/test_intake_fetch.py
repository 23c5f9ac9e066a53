"""The intake's own pull batches on a real nats-server: status messages end a batch,
a deleted consumer is made again, acks and naks keep delivery, and a health event is
handled while a telemetry backlog is still being worked through."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from gpuops.bus import wire
from gpuops.bus.conn import EVENTS, TELEMETRY, Bus
from gpuops.clock import SystemClock
from gpuops.errors import LeaseLost
from gpuops.intake.compact import FactsBook
from gpuops.intake.consumer import Intake, Priority
from gpuops.intake.fetch import Puller, PullError
from gpuops.match.facts import Telemetry
from gpuops.models import Event, new_event
from nats.js.api import AckPolicy, ConsumerConfig

from tests.conftest import wait_for

pytestmark = pytest.mark.integration


def _xid(node: str) -> bytes:
    return json.dumps(new_event("xid", node, time.time(), {"gpu": 0, "xid": 48}, "t")).encode()


def _telemetry(node: str) -> bytes:
    data = {"gpus": [{"index": i, "temp_c": 40.0 + i} for i in range(8)]}
    return json.dumps(new_event("telemetry", node, time.time(), data, "t")).encode()


async def _consumer(bus: Bus, durable: str) -> None:
    config = ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT, ack_wait=30)
    await bus.js.add_consumer(EVENTS, config)


async def test_a_batch_ends_on_the_servers_word_not_on_the_expiry(bus: Bus) -> None:
    await _consumer(bus, "p1")
    puller = Puller(bus.nc, EVENTS, "p1")
    try:
        assert await puller.fetch(16, 0.3) == []  # 408 after expiry: nothing pending
        for node in ("n1", "n2", "n3"):
            await bus.js.publish(f"gpuops.events.xid.{node}", _xid(node))
        started = asyncio.get_running_loop().time()
        msgs = await puller.fetch(16, 30.0)  # 3 pending, then 404: long before 30 s
        assert [json.loads(m.data)["node"] for m in msgs] == ["n1", "n2", "n3"]
        assert asyncio.get_running_loop().time() - started < 20.0
        for node in ("n4", "n5"):
            await bus.js.publish(f"gpuops.events.xid.{node}", _xid(node))
        assert len(await puller.fetch(2, 30.0)) == 2  # the batch count ends it
    finally:
        await puller.stop()


async def test_a_deleted_consumer_is_an_error_to_create_it_again(bus: Bus) -> None:
    await _consumer(bus, "p2")
    puller = Puller(bus.nc, EVENTS, "p2")
    try:
        fetching = asyncio.create_task(puller.fetch(16, 10.0))

        async def waiting() -> bool:  # the pull request is waiting on the server
            return (await bus.js.consumer_info(EVENTS, "p2")).num_waiting >= 1

        await wait_for(waiting, 10)
        await bus.js.delete_consumer(EVENTS, "p2")
        with pytest.raises(PullError, match="409"):
            await fetching
    finally:
        await puller.stop()


async def test_a_failed_handling_is_redelivered_and_a_handled_one_is_not(bus: Bus) -> None:
    seen: list[str] = []

    async def handle(event: Event | Telemetry) -> None:
        seen.append(event.node)
        if event.node == "bad" and seen.count("bad") == 1:
            raise RuntimeError("a handler bug, once")

    intake = Intake(
        bus.js, SystemClock(), stream=EVENTS, subject="gpuops.events.>", durable="p3",
        handler=handle,
    )  # fmt: skip
    for node in ("good", "bad"):
        await bus.js.publish(f"gpuops.events.xid.{node}", _xid(node))
    stop = asyncio.Event()
    task = asyncio.create_task(intake.run(stop))
    try:
        await wait_for(lambda: seen.count("bad") == 2, 30)  # nak'd: back after 5 s
    finally:
        stop.set()
        await task
    info = await bus.js.consumer_info(EVENTS, "p3")
    assert seen.count("good") == 1
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_a_sample_whose_handling_failed_is_a_dead_letter_not_acked_away(bus: Bus) -> None:
    """With AckAll the batch's ack covers a sample whose handling failed, so it is never
    redelivered: it goes to the dead letters as `undecided`, with its error, and every
    sample published is handled or dead-lettered, none twice."""
    handled: list[str] = []

    async def handle(event: Event | Telemetry) -> None:
        if event.node == "n3":
            raise TimeoutError("nats slow")  # what the pipeline's own tries did not get past
        handled.append(event.node)

    dead = await bus.nc.subscribe("gpuops.dlq.>")
    intake = Intake(
        bus.js, SystemClock(), stream=TELEMETRY, subject="gpuops.telemetry.>", durable="t4",
        handler=handle, ack_all=True,
    )  # fmt: skip
    published = [f"n{i}" for i in range(6)]
    for node in published:
        await bus.js.publish(f"gpuops.telemetry.{node}", _telemetry(node))
    stop = asyncio.Event()
    task = asyncio.create_task(intake.run(stop))
    try:
        letter = await dead.next_msg(timeout=30)
        await wait_for(lambda: len(handled) == 5, 30)
    finally:
        stop.set()
        await task
    record = json.loads(letter.data)
    assert letter.subject == "gpuops.dlq.undecided"
    assert "nats slow" in record["error"] and json.loads(record["payload"])["node"] == "n3"
    assert sorted([*handled, "n3"]) == published, "published = handled + dead-lettered"
    assert intake.dead == {"undecided": 1}
    info = await bus.js.consumer_info(TELEMETRY, "t4")
    assert info.num_ack_pending == 0 and info.num_pending == 0, "nothing comes back"


async def test_a_health_event_still_failing_on_its_last_delivery_is_a_dead_letter(
    bus: Bus,
) -> None:
    """NAK'd on its last delivery, a health event would never come back, and the acks of
    later events would move the floor past it (the next takeover replaying it as decided):
    it goes to the dead letters as `undecided` and is acked, so published = handled +
    dead-lettered. The server's max_deliver is the intake's, made small here."""
    handled: list[str] = []
    tries = 0

    async def handle(event: Event | Telemetry) -> None:
        nonlocal tries
        if event.node == "bad":
            tries += 1
            raise RuntimeError("a decider bug")
        handled.append(event.node)

    dead = await bus.nc.subscribe("gpuops.dlq.>")
    intake = Intake(
        bus.js, SystemClock(), stream=EVENTS, subject="gpuops.events.>", durable="p5",
        handler=handle, max_deliver=3, redeliver_s=0.05,
    )  # fmt: skip
    published = ["bad", "n1", "n2"]
    for node in published:
        await bus.js.publish(f"gpuops.events.xid.{node}", _xid(node))
    stop = asyncio.Event()
    task = asyncio.create_task(intake.run(stop))
    try:
        letter = await dead.next_msg(timeout=20)
        await wait_for(lambda: len(handled) == 2, 20)

        async def acked() -> bool:  # acks are published without waiting for an answer
            return (await bus.js.consumer_info(EVENTS, "p5")).ack_floor.stream_seq == 3

        await wait_for(acked, 10)
        info = await bus.js.consumer_info(EVENTS, "p5")
    finally:
        stop.set()
        await task
    record = json.loads(letter.data)
    assert letter.subject == "gpuops.dlq.undecided"
    assert "a decider bug" in record["error"] and json.loads(record["payload"])["node"] == "bad"
    assert tries == 3, "delivered max_deliver times, then dead-lettered"
    assert sorted([*handled, "bad"]) == sorted(published), "published = handled + dead-lettered"
    assert intake.dead == {"undecided": 1}
    assert info.num_ack_pending == 0 and info.num_pending == 0, "acked, not left to the server"


class _FaultyBook(FactsBook):
    """A book whose join fails as a decoder's bug would, on one node's samples: not an
    EventError, which is how every refusal the decoder knows is raised."""

    def join(self, doc: Any, json: bool, publisher: str = "") -> Telemetry:
        if doc.node == "n3":
            raise IndexError("tuple index out of range")
        return super().join(doc, json, publisher)


@pytest.mark.parametrize("ack_all", [True, False], ids=["telemetry, AckAll", "one by one"])
async def test_a_message_the_decoder_fails_on_is_a_dead_letter_not_a_stuck_partition(
    bus: Bus, ack_all: bool
) -> None:
    """Review of issue 30: a v2 keyframe made the decoder raise IndexError, which escaped
    the intake; it restarted and the batch came back, again and again, holding up the
    partition. Whatever the decoder raises on one message, that message goes to the
    dead letters (`undecodable`, with the error) and the others are handled, once."""
    handled: list[str] = []

    async def handle(event: Event | Telemetry) -> None:
        handled.append(event.node)

    dead = await bus.nc.subscribe("gpuops.dlq.>")
    intake = Intake(
        bus.js, SystemClock(), stream=TELEMETRY, subject="gpuops.telemetry.>",
        durable=f"t5{int(ack_all)}", handler=handle, ack_all=ack_all, facts=_FaultyBook(),
    )  # fmt: skip
    writer = wire.TelemetryWriter("agent")
    published = [f"n{i}" for i in range(6)]
    gpus = [{"index": i, "temp_c": 40.0 + i} for i in range(8)]
    for node in published:
        await bus.js.publish(f"gpuops.telemetry.{node}", writer.encode(node, time.time(), gpus))
    stop = asyncio.Event()
    task = asyncio.create_task(intake.run(stop))
    try:
        letter = await dead.next_msg(timeout=30)
        await wait_for(lambda: len(handled) == 5, 30)
        await asyncio.sleep(0.5)  # time for a redelivery, were there one
    finally:
        stop.set()
        await task
    record = json.loads(letter.data)
    assert letter.subject == "gpuops.dlq.undecodable"
    assert "IndexError: tuple index out of range" in record["error"], record["error"]
    assert sorted([*handled, "n3"]) == published, "published = handled + dead-lettered, once"
    assert intake.dead == {"undecodable": 1}
    info = await bus.js.consumer_info(TELEMETRY, f"t5{int(ack_all)}")
    assert info.num_ack_pending == 0 and info.num_pending == 0, "nothing comes back"


@pytest.mark.parametrize("ack_all", [True, False], ids=["telemetry, AckAll", "one by one"])
async def test_a_batch_cut_short_by_an_error_is_handled_first_when_the_intake_restarts(
    bus: Bus, ack_all: bool
) -> None:
    """Review of issue 30: an error out of a batch's handling (the fence's LeaseLost, a
    dead letter whose publish failed) ends the intake, and its supervisor starts it again
    on the same consumer, which does not deliver the rest of that batch again before
    ack_wait. With AckAll the next batch's ack then covered them: lost, never handled.
    Now the rest of the batch, the message that failed first, is handled before the
    intake pulls again: published = handled, each once, and nothing is left pending."""
    handled: list[str] = []
    failed: list[str] = []

    async def handle(event: Event | Telemetry) -> None:
        if event.node == "n3" and not failed:
            failed.append(event.node)
            raise LeaseLost("the partition of n3 is not held here (for an instant)")
        handled.append(event.node)

    durable = f"t6{int(ack_all)}"
    stream, prefix = (TELEMETRY, "gpuops.telemetry") if ack_all else (EVENTS, "gpuops.events")
    intake = Intake(
        bus.js, SystemClock(), stream=stream, subject=f"{prefix}.>", durable=durable,
        handler=handle, ack_all=ack_all,
    )  # fmt: skip
    body, subject = (_telemetry, prefix) if ack_all else (_xid, f"{prefix}.xid")
    first, then = [f"n{i}" for i in range(10)], [f"m{i}" for i in range(5)]
    for node in first:
        await bus.js.publish(f"{subject}.{node}", body(node))
    stop = asyncio.Event()
    with pytest.raises(LeaseLost):
        await intake.run(stop)  # in one batch: n0-n2 handled, n3 raised
    assert handled == ["n0", "n1", "n2"]
    for node in then:
        await bus.js.publish(f"{subject}.{node}", body(node))
    task = asyncio.create_task(intake.run(stop))  # as the supervisor starts it again
    try:
        await wait_for(lambda: len(handled) == len(first) + len(then), 30)
        await asyncio.sleep(0.5)  # time for a redelivery, were there one
    finally:
        stop.set()
        await task
    assert handled == first + then, "in order, each once"
    info = await bus.js.consumer_info(stream, durable)
    assert info.num_ack_pending == 0 and info.num_pending == 0, "nothing comes back"


@pytest.mark.slow
async def test_a_health_event_is_handled_before_the_telemetry_backlog(bus: Bus) -> None:
    """With telemetry 2,000 samples behind, an XID is handled within a few samples of
    its arrival, not after the telemetry batch being worked on (256 samples)."""
    for i in range(2000):
        await bus.nc.publish(f"gpuops.telemetry.n{i % 100}", _telemetry(f"n{i % 100}"))
    await bus.nc.flush()
    handled: list[tuple[str, int]] = []
    samples = 0

    async def on_telemetry(event: Event | Telemetry) -> None:
        nonlocal samples
        busy = time.perf_counter() + 0.001  # an engine matching a sample on a busy host
        while time.perf_counter() < busy:
            pass
        samples += 1

    async def on_event(event: Event | Telemetry) -> None:
        handled.append((event.node, samples))

    priority = Priority()
    common: dict[str, Any] = {"priority": priority}
    intakes = [
        Intake(bus.js, SystemClock(), stream=TELEMETRY, subject="gpuops.telemetry.>",
               durable="t", handler=on_telemetry, ack_all=True, **common),
        Intake(bus.js, SystemClock(), stream=EVENTS, subject="gpuops.events.>",
               durable="e", handler=on_event, batch=16, urgent=True, **common),
    ]  # fmt: skip
    stop = asyncio.Event()
    tasks = [asyncio.create_task(i.run(stop)) for i in intakes]
    try:
        await wait_for(lambda: samples > 100, 30)
        await bus.js.publish("gpuops.events.xid.sick", _xid("sick"))
        published_at = samples
        await wait_for(lambda: handled, 30)
        waited = handled[0][1] - published_at
        assert waited < 64, f"the XID waited behind {waited} samples"
        await wait_for(lambda: samples == 2000, 60)
    finally:
        stop.set()
        await asyncio.gather(*tasks)
    info = await bus.js.consumer_info(TELEMETRY, "t")
    assert info.num_pending == 0 and info.num_ack_pending == 0


async def test_telemetry_lingers_between_batches_that_were_not_full(bus: Bus) -> None:
    """A steady trickle is taken in a few larger batches, not a pull and an ack for each
    sample; a backlog (full batches) is worked through without pausing."""
    batches: list[int] = []

    async def on_telemetry(event: Event | Telemetry) -> None:
        pass

    handling: list[float] = []

    def seen(messages: int, busy_s: float) -> None:  # the intake's report of each pull
        batches.append(messages)
        handling.append(busy_s)

    linger_s = 0.2
    intake = Intake(
        bus.js, SystemClock(), stream=TELEMETRY, subject="gpuops.telemetry.>",
        durable="linger", handler=on_telemetry, ack_all=True, batch=64, linger_s=linger_s,
        on_batch=seen,
    )  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(intake.run(stop))
    try:
        began = time.monotonic()
        for i in range(100):  # 100 samples over about 2 s
            await bus.nc.publish(f"gpuops.telemetry.n{i}", _telemetry(f"n{i}"))
            await asyncio.sleep(0.02)
        trickle_s = time.monotonic() - began
        await wait_for(lambda: sum(batches) == 100, 30)
    finally:
        stop.set()
        await task
    trickled = batches[:]
    for i in range(1000):  # a backlog, while nothing reads
        await bus.nc.publish(f"gpuops.telemetry.b{i % 50}", _telemetry(f"b{i % 50}"))
    await bus.nc.flush()
    stop = asyncio.Event()
    task = asyncio.create_task(intake.run(stop))
    try:
        began = time.monotonic()
        await wait_for(lambda: sum(batches) == 1100, 30)
        backlog_s = time.monotonic() - began
    finally:
        stop.set()
        await task
    # At most one batch per linger (plus the first and the last), where without it each
    # sample came alone.
    assert len(trickled) <= trickle_s / linger_s + 3, trickled
    # The backlog came in full batches, with no pause between them (15 lingers: 3 s).
    assert batches[len(trickled) :] == [64] * 15 + [40], batches
    assert backlog_s < 15 * linger_s, backlog_s
    assert all(busy_s >= 0 for busy_s in handling) and len(handling) == len(batches)

    # The last batch's ack went as the intake stopped (it goes with the next pull
    # otherwise); the server takes it a moment later than its answer to a request.
    async def settled() -> bool:
        info = await bus.js.consumer_info(TELEMETRY, "linger")
        return info.num_pending == 0 and info.num_ack_pending == 0

    await wait_for(settled, 10)
