"""A takeover cut short and started again, on a real nats-server: what it replays into
the windows is what was decided, once, whichever part of it failed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import TypeVar

import pytest
from gpuops.bus.conn import EVENTS, Bus
from gpuops.bus.partitions import partition_of
from gpuops.bus.server import EmbeddedNats
from gpuops.clock import SystemClock
from gpuops.intake.consumer import Intake
from gpuops.intake.decode import decode_intake
from gpuops.match.facts import Telemetry
from gpuops.match.loader import load_rules
from gpuops.match.matcher import Matcher
from gpuops.models import Event, new_event
from gpuops.record.metrics import Metrics
from gpuops.scale.replica import Partitions, filters
from gpuops.scale.takeover import Takeover, take_over
from gpuops.settings import NatsSettings

from tests.conftest import ROOT, wait_for

pytestmark = pytest.mark.integration

NODE = "node-001"
PARTS = NatsSettings().partitions  # as the `bus` fixture split the streams
PART = partition_of(NODE, PARTS)
DBE = """\
rules:
  - name: xid-48-dbe-repeating
    description: five double-bit ECC errors on one GPU within a day
    on: xid
    group_by: [node, gpu]
    when: xid == 48
    count: 5
    within: 24h
    actions:
      - playbook: collect_diagnostics.yml
"""


def _xid48(t: float) -> bytes:
    return json.dumps(new_event("xid", NODE, t, {"gpu": 0, "xid": 48}, "agent")).encode()


def _intake(bus: Bus, stream: str, telemetry: bool, p: int, durable: str) -> Intake:
    """A partition's intake as the engine makes it; what it handles is not looked at."""

    async def handled(_: Event | Telemetry) -> None:
        pass

    return Intake(
        bus.js, SystemClock(), stream=stream, subject=filters(telemetry, p), durable=durable,
        handler=handled, ack_all=telemetry, create=False,
    )  # fmt: skip


async def _decided_by_last_owner(bus: Bus, n: int) -> None:
    """`n` XID 48s on the stream, decided and acked by an owner of epoch 1."""
    t0 = time.time() - 60
    for start in range(0, n, 250):
        await asyncio.gather(*(
            bus.js.publish(f"gpuops.events.xid.{NODE}", _xid48(t0 + k * 0.01))
            for k in range(start, min(n, start + 250))
        ))  # fmt: skip
    config = _intake(bus, EVENTS, False, PART, "probe").consumer_config()
    first = await take_over(
        bus.js, stream=EVENTS, telemetry=False, partition=PART, epoch=1, config=config,
        span_s=0, now=time.time(), feed=lambda _: None, lease_epoch=lambda: asyncio.sleep(0, 1),
    )  # fmt: skip

    async def acked() -> bool:
        return (await bus.js.consumer_info(EVENTS, first.durable)).ack_floor.stream_seq == n

    intake, stop = _intake(bus, EVENTS, False, PART, first.durable), asyncio.Event()
    task = asyncio.create_task(intake.run(stop))
    try:
        await wait_for(acked, 20)
    finally:
        stop.set()
        await task


class _TelemetrySlow(Partitions):
    """The partition's telemetry takeover times out once (JetStream too slow: what a gain
    is started again on) while its events takeover still waits its turn."""

    failed = False

    async def _take_over(
        self, p: int, epoch: int, telemetry: bool, stream: str, probe: Intake
    ) -> Takeover:
        if p == PART and telemetry and not self.failed:
            self.failed = True
            await asyncio.sleep(0.05)
            raise TimeoutError("telemetry takeover too slow")
        if p == PART and not telemetry:
            await asyncio.sleep(0.5)  # behind others' takeovers (TAKEOVERS_AT_ONCE)
        return await super()._take_over(p, epoch, telemetry, stream, probe)


def _matcher(tmp_path: Path) -> Matcher:
    """The matcher over the count rule alone."""
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / "dbe.yml").write_text(DBE)
    return Matcher(load_rules([tmp_path / "rules"], ROOT / "playbooks"))


P = TypeVar("P", bound=Partitions)


def _partitions(kind: type[P], bus: Bus, matcher: Matcher) -> P:
    """One replica's partitions of the node's stream (`kind`: Partitions or a test's)."""
    return kind(
        bus.js, bus.buckets.leases, "replica-a", PARTS, 6.0, SystemClock(), matcher,
        frozenset({NODE}), lambda *made: _intake(bus, *made), Metrics(),
    )  # fmt: skip


async def test_a_takeover_started_again_replays_the_decided_events_once(
    bus: Bus, tmp_path: Path
) -> None:
    """Review B: the two streams' takeovers ran under a gather, which left the events one
    running when the telemetry one failed; the gain cleared the windows and started again,
    and both replayed the 3 decided XID 48s: the count rule fired on the 4th, not the 5th."""
    await _decided_by_last_owner(bus, 3)
    matcher = _matcher(tmp_path)
    parts = _partitions(_TelemetrySlow, bus, matcher)
    try:
        await parts.ownership.round()  # takes every partition; the gains run beside it
        await wait_for(lambda: PART in parts.ready, 20)
        await asyncio.sleep(0.6)  # what a takeover left running would be done by now
        assert parts.failed, "the telemetry takeover failed once and was started again"
        fourth = matcher.match(decode_intake(_xid48(time.time())))
        fifth = matcher.match(decode_intake(_xid48(time.time())))
    finally:
        parts.ownership.closing.set()
        await parts.ownership.release_all()
        for p in list(parts.workers):
            await parts.lose(p)
    assert fourth == [], "3 decided + this one: 4 of 5"
    assert [m.rule for m in fifth] == ["xid-48-dbe-repeating"]


async def test_a_takeover_warms_every_decided_event_through_a_nats_stall(
    bus: Bus, nats_server: EmbeddedNats
) -> None:
    """Review B: the warm-up took a fetch timing out (2 s) for the end of what was stored:
    nats-server paused for 3 s after the first batch, and the takeover went on with 1,024
    of the 2,000 decided events in its windows. The server is stopped (SIGSTOP) for
    real here, and the warm-up asks again while the read's consumer has messages pending."""
    decided = 2000
    await _decided_by_last_owner(bus, decided)
    pid, loop, fed = nats_server.pid, asyncio.get_running_loop(), 0
    assert pid is not None

    stalled = False

    def feed(_: Event | Telemetry) -> None:
        nonlocal fed, stalled
        fed += 1
        if fed == 1024 and not stalled:  # the first batch is in: NATS stalls, once, for
            stalled = True  # longer than a fetch waits
            os.kill(pid, signal.SIGSTOP)
            loop.call_later(3.0, os.kill, pid, signal.SIGCONT)

    config = _intake(bus, EVENTS, False, PART, "probe").consumer_config()
    tries = 0
    try:
        while True:  # as the gain does: a takeover that raised TimeoutError starts again
            tries += 1
            fed = 0 if tries > 1 else fed
            try:
                done = await take_over(
                    bus.js, stream=EVENTS, telemetry=False, partition=PART, epoch=2,
                    config=config, span_s=3600, now=time.time(), feed=feed,
                    lease_epoch=lambda: asyncio.sleep(0, 2),
                )  # fmt: skip
                break
            except TimeoutError:  # the stall lost what the server sent meanwhile: said so
                assert tries == 1, "only the stalled read is given up"
                await asyncio.sleep(3.0)  # the server is back
    finally:
        os.kill(pid, signal.SIGCONT)  # never left stopped, whatever the takeover did
    assert done.floor == decided
    assert done.warmed == fed == decided, "every decided event is in the windows"


async def test_a_partition_given_back_when_its_consumer_went_keeps_no_task(
    bus: Bus, tmp_path: Path
) -> None:
    """A partition's consumer deleted under it (taken over elsewhere) is given back by a
    task of its own; done, the task is let go (every one was kept for the engine's life)."""
    parts = _partitions(Partitions, bus, _matcher(tmp_path))
    try:
        await parts.ownership.round()
        await wait_for(lambda: PART in parts.ready and PART in parts.workers, 20)
        await bus.js.delete_consumer(EVENTS, parts.names[(False, PART)])
        await wait_for(lambda: not parts.ownership.holds(PART), 20)
        await wait_for(lambda: not parts._releasing, 5)
    finally:
        parts.ownership.closing.set()
        await parts.ownership.release_all()
        for p in list(parts.workers):
            await parts.lose(p)
