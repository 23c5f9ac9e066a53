"""A takeover of a partition whose agents send telemetry v2, on a real nats-server: the
warm-up reads the decided samples again joined to their node's static facts (from the
keyframes read again, else from KV), so a `for:` window goes on where the last owner
left it, as it does for v1."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gpuops.bus import wire
from gpuops.bus.conn import TELEMETRY, Bus
from gpuops.bus.partitions import partition_of
from gpuops.clock import SystemClock
from gpuops.intake.compact import FactsBook
from gpuops.intake.consumer import Intake
from gpuops.match.facts import Telemetry
from gpuops.match.loader import load_rules
from gpuops.match.matcher import Matcher
from gpuops.models import Event
from gpuops.scale.replica import filters
from gpuops.scale.takeover import take_over
from gpuops.settings import NatsSettings

from tests.conftest import ROOT, wait_for

pytestmark = pytest.mark.integration

NODE = "node-001"
HOT = """\
rules:
  - name: gpu-hot
    description: hot for 20 s
    on: telemetry
    group_by: [node, gpu]
    when: temp_c >= 85
    for: 20s
    actions:
      - playbook: drain.yml
"""


def _gpus() -> list[dict[str, Any]]:
    return [
        {"index": i, "uuid": f"GPU-{i}", "power_limit_w": 700.0, "temp_c": 90.0} for i in range(4)
    ]


async def _consume(
    bus: Bus, durable: str, book: FactsBook, handle: Callable[..., Any], n: int
) -> Intake:
    """The partition's telemetry intake until it has handled `n` samples."""
    seen: list[object] = []

    async def handler(event: Event | Telemetry) -> None:
        seen.append(event)
        await handle(event)

    intake = Intake(
        bus.js, SystemClock(), stream=TELEMETRY, subject=filters(True, _partition()),
        durable=durable, handler=handler, ack_all=True, create=False, facts=book,
    )  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(intake.run(stop))
    try:
        await wait_for(lambda: len(seen) == n, 30)
    finally:
        stop.set()
        await task
    return intake


def _partition() -> int:
    return partition_of(NODE, NatsSettings().partitions)


@pytest.mark.parametrize("kv", ["facts in KV", "facts not saved"])
async def test_a_takeover_warms_a_for_window_from_v2_samples(
    bus: Bus, tmp_path: Path, kv: str
) -> None:
    """Review of issue 30: the warm-up read every message as v1 and dropped each v2
    sample as undecodable, so the new owner's windows started empty: a `for: 20s` 10 s
    along fired 10 s late. With the last owner's facts never saved (KV failing), the
    new owner refused every sample until the node's next keyframe, though that keyframe
    was among the messages read again."""
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / "hot.yml").write_text(HOT)
    rules = load_rules([tmp_path / "rules"], ROOT / "playbooks")
    probe = Intake(
        bus.js, SystemClock(), stream=TELEMETRY, subject=filters(True, _partition()),
        durable="probe", handler=None, ack_all=True,  # type: ignore[arg-type]
    )  # fmt: skip
    writer, t0 = wire.TelemetryWriter("agent"), float(int(time.time()) - 100)

    async def publish(ks: range) -> None:
        for k in ks:
            await bus.js.publish(f"gpuops.telemetry.{NODE}", writer.encode(NODE, t0 + k, _gpus()))

    async def taken(epoch: int, feed: Callable[..., None], book: FactsBook) -> tuple[int, str]:
        done = await take_over(
            bus.js, stream=TELEMETRY, telemetry=True, partition=_partition(), epoch=epoch,
            config=probe.consumer_config(), span_s=60, now=time.time(), feed=feed,
            lease_epoch=lambda: asyncio.sleep(0, epoch), book=book,
        )  # fmt: skip
        return done.warmed, done.durable

    # The last owner decides t0 .. t0+9 (the first a keyframe) and acks them.
    await publish(range(10))
    last = Matcher(rules)
    _, first = await taken(1, last.warm, FactsBook())

    async def decide_last(event: Event | Telemetry) -> None:
        last.match(event)

    saving = FactsBook(bus.buckets.facts if kv == "facts in KV" else None)
    await _consume(bus, first, saving, decide_last, 10)
    assert (await bus.buckets.facts.get(NODE) is not None) is (kv == "facts in KV")

    # A new owner takes over: the 10 decided samples warm its window, then it decides.
    new, book = Matcher(rules), FactsBook(bus.buckets.facts)
    warmed, second = await taken(2, new.warm, book)
    assert warmed == 10, "every decided sample read again"
    fired: list[float] = []

    async def decide_new(event: Event | Telemetry) -> None:
        if new.match(event):
            fired.append(event.epoch - t0)

    await publish(range(10, 31))
    after = await _consume(bus, second, book, decide_new, 21)
    assert after.dead == {}, "no sample refused"
    assert fired and fired[0] == 20, f"fired at t0+{fired[:1]}: on the sample 20 s after the first"
