"""Issue 31, item 2: size is checked where it is made.

On a real nats-server, through the engine's own intake and pipeline (in-process): a
valid event of 1 MiB - 300 B, 800 KB of binary and 200 KB of control characters, each
on the health events subject and on the telemetry subject, signed as their node. Each
is decided or dead-lettered, counted from the streams (what the partition's consumer
acked, what the dead-letter stream holds), and the partition goes on deciding another
node's event published after it.

Before: the valid XID was accepted, its intent (which carries its facts) was over
NATS's max payload, the handler failed on every redelivery and the consumer gave up
with nothing recorded; on telemetry, the next sample's ack-all acked it away.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from pathlib import Path
from typing import Any

import pytest
from gpuops import subjects
from gpuops.bus.conn import ACTIONS, DLQ, Bus
from gpuops.bus.identity import KeyRing
from gpuops.bus.partitions import partition_of
from gpuops.bus.server import EmbeddedNats
from gpuops.intake.decode import MAX_EVENT_BYTES
from gpuops.models import MAX_TEXT, new_event
from gpuops.record.audit import read_audit
from gpuops.scale.lag import drained, handled, lags
from gpuops.settings import NatsSettings
from gpuops.sim.fleet import SimFleet

from tests.conftest import engine_settings, running_engine, wait_for
from tests.support import as_node

pytestmark = pytest.mark.faults

PARTITIONS = NatsSettings().partitions
NATS_MAX_PAYLOAD = 1 << 20
BAD = "node-001"


@pytest.fixture
def fleet(tmp_path: Path) -> SimFleet:
    """node-001 and enough others that one shares its partition."""
    return SimFleet.create(tmp_path / "sim", nodes=16, gpus=4)


def _neighbour(fleet: SimFleet) -> str:
    """Another node of node-001's partition: its events wait behind the bad one."""
    mine = partition_of(BAD, PARTITIONS)
    return next(n for n in fleet.nodes[1:] if partition_of(n, PARTITIONS) == mine)


def _xid(node: str, message: str = "", xid: int = 62) -> dict[str, Any]:
    """An XID that `xid-reset-class` decides at once (a GPU reset)."""
    return new_event("xid", node, time.time(), {"gpu": 1, "xid": xid, "message": message}, "kmsg")


def _sample(node: str, name: str = "NVIDIA H200") -> dict[str, Any]:
    """A sample that `remap-failure` decides at once."""
    gpu = {"index": 0, "name": name, "temp_c": 40.0, "remap_failure": True}
    return new_event("telemetry", node, time.time(), {"gpus": [gpu]}, "agent")


def _grown(doc: dict[str, Any], put: Any, size: int) -> bytes:
    """`doc` with the text `put` sets grown until the payload is `size` bytes."""
    put(doc, "")
    put(doc, "x" * (size - len(json.dumps(doc).encode())))
    payload = json.dumps(doc).encode()
    assert len(payload) == size
    return payload


def _valid(kind: str) -> bytes:
    """A valid event of 1 MiB - 300 B: its free text is nearly all of it."""
    size = NATS_MAX_PAYLOAD - 300
    if kind == "telemetry":
        return _grown(_sample(BAD), lambda d, t: d["data"]["gpus"][0].update(name=t), size)
    return _grown(_xid(BAD), lambda d, t: d["data"].update(message=t), size)


SHAPES: dict[str, tuple[Any, str]] = {
    "valid 1 MiB - 300 B": (_valid, "too_large"),
    # 2324a96 already bounded the dead-letter record of these two (the payload cut at
    # 64 KiB, control characters as base64; before it, both failed here with "maximum
    # payload exceeded"). The control characters pass on that commit as they are; the
    # binary was dead-lettered as `json` and is now refused as `too_large` before it is
    # read. Both stay, to hold the records to one NATS message end to end.
    "800 KB of binary": (lambda kind: random.Random(31).randbytes(800_000), "too_large"),
    "200 KB of control characters": (
        lambda kind: bytes(range(1, 32)) * (200_000 // 31),
        "json",
    ),
}


async def _publish(bus: Bus, keys: KeyRing, subject: str, payload: bytes, msg_id: str) -> None:
    await bus.js.publish(subject, payload, headers=as_node(keys, subject, payload, msg_id))


async def _dead_letters(bus: Bus) -> list[tuple[int, dict[str, Any]]]:
    """Every dead-letter record, with its size in bytes."""
    info = await bus.js.stream_info(DLQ)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages else ():
        data = (await bus.js.get_msg(DLQ, seq)).data or b""
        out.append((len(data), json.loads(data)))
    return out


async def _decided(bus: Bus, node: str, rule: str) -> list[dict[str, Any]]:
    return [
        r.body async for r in read_audit(bus.js, node) if r.type == "decision" and r.rule == rule
    ]


@pytest.mark.parametrize("stream", ["events", "telemetry"])
@pytest.mark.parametrize("shape", list(SHAPES))
async def test_an_oversized_or_malformed_message_is_dead_lettered_and_counted_and_its_partition_decides_on(  # noqa: E501
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats, stream: str, shape: str
) -> None:
    telemetry = stream == "telemetry"
    make, reason = SHAPES[shape]
    bad = make("telemetry" if telemetry else "xid")
    other = _neighbour(fleet)
    rule = "remap-failure" if telemetry else "xid-reset-class"
    good = _sample(other) if telemetry else _xid(other)
    subject = subjects.telemetry if telemetry else (lambda node: subjects.event("xid", node))
    settings = engine_settings(tmp_path, fleet, nats_server.url, role="engine")
    async with running_engine(settings, bus) as app:
        await _publish(bus, app.keys, subject(BAD), bad, "bad-1")
        await _publish(bus, app.keys, subject(other), json.dumps(good).encode(), good["id"])
        await wait_for(lambda: _decided(bus, other, rule), 30)  # the partition goes on
        await wait_for(lambda: drained(bus.js, telemetry, PARTITIONS), 30)
        parts = await lags(bus.js, telemetry, PARTITIONS)
    letters = await _dead_letters(bus)
    assert handled(parts) == 2, parts  # published = decided + dead-lettered, all acked
    assert [(letter["reason"], letter["payload_bytes"]) for _, letter in letters] == [
        (reason, len(bad))
    ], shape
    ((size, letter),) = letters
    assert letter["payload_sha256"] == hashlib.sha256(bad).hexdigest()
    assert size < 256 * 1024, "the record is one NATS message, with room to spare"
    assert [r async for r in read_audit(bus.js, BAD) if r.type == "decision"] == []


async def test_an_xid_under_the_limit_with_a_long_message_is_decided_with_it_cut(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    doc = _xid(BAD)
    payload = _grown(doc, lambda d, t: d["data"].update(message=t), MAX_EVENT_BYTES)
    message = json.loads(payload)["data"]["message"]
    settings = engine_settings(tmp_path, fleet, nats_server.url, role="engine")
    async with running_engine(settings, bus) as app:
        await _publish(bus, app.keys, subjects.event("xid", BAD), payload, doc["id"])
        await wait_for(lambda: _decided(bus, BAD, "xid-reset-class"), 30)
        await wait_for(lambda: drained(bus.js, False, PARTITIONS), 30)
    assert (await bus.js.stream_info(DLQ)).state.messages == 0
    ((body,),) = [await _decided(bus, BAD, "xid-reset-class")]
    assert body["decision"]["accepted"], body
    cut = body["facts"]["message"]
    kept = cut.index("…")
    digest = hashlib.sha256(message.encode()).hexdigest()
    assert len(cut) <= MAX_TEXT
    assert cut == message[:kept] + f"…[cut {len(message) - kept} chars, sha256 {digest}]"
    intent = await bus.js.get_msg(ACTIONS, (await bus.js.stream_info(ACTIONS)).state.last_seq)
    assert len(intent.data or b"") < 64 * 1024, "the intent carries the cut message only"
    assert json.loads(intent.data or b"")["decision"]["match"]["facts"]["message"] == cut
