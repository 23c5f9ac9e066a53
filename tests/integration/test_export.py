"""`gpuops export` against a real nats-server: filters by time, node and kind, and the lines
replay like the events that were published."""

from __future__ import annotations

import io
import json
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from gpuops import shipped
from gpuops.bus.conn import EVENTS, TELEMETRY, Bus, open_bus
from gpuops.bus.server import EmbeddedNats
from gpuops.bus.wire import TelemetryWriter
from gpuops.clock import from_rfc3339
from gpuops.intake.compact import FactsBook
from gpuops.intake.decode import decode
from gpuops.match.facts import Telemetry
from gpuops.match.loader import load_rules
from gpuops.models import subject_for
from gpuops.ops.export import Selection, _read, export
from gpuops.settings import NatsSettings
from gpuops.spine.replay import replay, replay_file

from tests.support import gpuops_argv

pytestmark = pytest.mark.integration
RECORDING = shipped.shipped("examples") / "recording.jsonl"


def _recorded() -> list[dict[str, Any]]:
    return [json.loads(line) for line in RECORDING.read_text().splitlines()]


async def _publish(bus: Bus, events: list[dict[str, Any]]) -> None:
    for event in events:
        await bus.js.publish(subject_for(event["kind"], event["node"]), json.dumps(event).encode())


async def _export(bus: Bus, selection: Selection, fmt: int = 1) -> list[dict[str, Any]]:
    out = io.BytesIO()
    await export(bus.js, selection, out, fmt)
    return [json.loads(line) for line in out.getvalue().splitlines()]


async def _would_run(path: Path) -> list[dict[str, Any]]:
    rules = load_rules([shipped.shipped("rules")], shipped.shipped("playbooks"))
    actions, _ = await replay_file(path, rules, None)
    return [a.as_dict() for a in actions]


async def test_everything_exported_replays_like_the_recording(bus: Bus, tmp_path: Path) -> None:
    events = _recorded()
    await _publish(bus, events)
    exported = await _export(bus, Selection())
    assert exported == events, "every event once, in the order it was stored"
    path = tmp_path / "export.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in exported))
    replayed = await _would_run(path)
    assert replayed == await _would_run(RECORDING)
    assert {a["action"] for a in replayed} >= {"power_limit.yml", "reboot.yml"}


async def _last_stored(bus: Bus, stream: str) -> datetime:
    """When the stream stored its newest message, by the server's clock."""
    state = (await bus.js.stream_info(stream)).state
    if state.messages == 0:
        return datetime.min.replace(tzinfo=UTC)
    stored = (await bus.js.get_msg(stream, state.last_seq)).time
    assert stored is not None
    return stored


async def test_node_kind_and_time_filters_select_only_their_events(bus: Bus) -> None:
    events = _recorded()
    half = len(events) // 2
    await _publish(bus, events[:half])
    # Just after the first half was stored (the server's clock): the second half is later.
    stored = [await _last_stored(bus, stream) for stream in (TELEMETRY, EVENTS)]
    middle = max(stored) + timedelta(microseconds=1)
    await _publish(bus, events[half:])

    later = await _export(bus, Selection(since=middle))
    assert later == events[half:]
    earlier = await _export(bus, Selection(until=middle))
    assert earlier == events[:half]
    node = await _export(bus, Selection(nodes=("gpu-a01-01",)))
    assert node == [e for e in events if e["node"] == "gpu-a01-01"]
    xids = await _export(bus, Selection(kinds=("xid",), nodes=("gpu-a01-02",)))
    assert xids == [e for e in events if e["kind"] == "xid"] and len(xids) == 1
    both = await _export(bus, Selection(kinds=("xid", "telemetry"), since=middle))
    assert both == events[half:]
    assert await _export(bus, Selection(nodes=("no-such-node",))) == []


async def test_an_export_ends_at_the_stream_end_as_it_began(bus: Bus) -> None:
    telemetry = [e for e in _recorded() if e["kind"] == "telemetry"]
    await _publish(bus, telemetry)
    reader = _read(bus.js, TELEMETRY, ["gpuops.telemetry.*.*"], Selection())
    first = await anext(reader)
    # The stream grows while the export runs, as a live fleet's telemetry does.
    await _publish(bus, [{**e, "id": f"late-{e['id']}"} for e in telemetry])
    rest = [item async for item in reader]
    read = [json.loads(payload)["id"] for _, _, payload, _ in [first, *rest]]
    assert read == [e["id"] for e in telemetry]


async def test_the_cli_role_of_the_embedded_server_may_export_telemetry(tmp_path: Path) -> None:
    events = _recorded()
    async with open_bus(NatsSettings(), tmp_path / "state", role="engine") as engine:
        await _publish(engine, events)
        async with open_bus(NatsSettings(), tmp_path / "state", role="cli") as cli:
            assert await _export(cli, Selection(kinds=("telemetry",))) == [
                e for e in events if e["kind"] == "telemetry"
            ]


def test_the_export_command_writes_lines_publish_reads(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    url = nats_server.url
    done = subprocess.run(
        # A bare nats-server, no engine to publish them: straight to their subjects.
        gpuops_argv("publish", "--direct", "--nats", url, str(RECORDING)),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    out = tmp_path / "xid.jsonl"
    args = ["export", "--nats", url, "--kind", "xid", "--since", "1h", "-o", str(out)]
    done = subprocess.run(
        gpuops_argv(*args),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert "exported 1 events (1 from GPUOPS_EVENTS)" in done.stderr
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["gpu-a01-02-xid79"]
    bad = subprocess.run(
        gpuops_argv("export", "--nats", url, "--since", "yesterday"),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert bad.returncode == 2 and "bad time 'yesterday'" in bad.stderr


async def _publish_v2(bus: Bus, events: list[dict[str, Any]], writer: TelemetryWriter) -> None:
    """The recording as today's agents send it: telemetry v2 (MessagePack), the rest v1."""
    for e in events:
        payload = json.dumps(e).encode()
        if e["kind"] == "telemetry":
            payload = writer.encode(e["node"], from_rfc3339(e["ts"]), e["data"]["gpus"], e["id"])
        await bus.js.publish(subject_for(e["kind"], e["node"]), payload)


async def test_v2_telemetry_exports_in_either_format_and_replays_like_the_recording(
    bus: Bus, tmp_path: Path
) -> None:
    events = _recorded()
    await _publish_v2(bus, events, TelemetryWriter("agent"))
    expected = await _would_run(RECORDING)
    for fmt in (1, 2):
        out = io.BytesIO()
        done = await export(bus.js, Selection(), out, fmt)
        assert done.total == len(events) and done.unjoined == 0
        path = tmp_path / f"v{fmt}.jsonl"
        path.write_bytes(out.getvalue())
        assert await _would_run(path) == expected, f"format {fmt} replays as the recording"
    lines = [json.loads(line) for line in path.read_bytes().splitlines()]
    telemetry = [line for line in lines if line.get("v") == 2]
    nodes = {e["node"] for e in events if e["kind"] == "telemetry"}
    assert len(telemetry) == sum(e["kind"] == "telemetry" for e in events)
    assert sum("static" in line for line in telemetry) == len(nodes), "static once per node"


async def test_an_export_after_the_keyframes_joins_samples_to_the_facts_the_engine_kept(
    bus: Bus, tmp_path: Path
) -> None:
    telemetry = [e for e in _recorded() if e["kind"] == "telemetry"]
    half = len(telemetry) // 2
    writer, book = TelemetryWriter("agent", every_s=1e9), FactsBook(bus.buckets.facts)
    for e in telemetry[:half]:  # the engine reads the keyframes and keeps their facts
        payload = writer.encode(e["node"], from_rfc3339(e["ts"]), e["data"]["gpus"], e["id"])
        book.telemetry(payload)
        await book.save(e["node"])
        await bus.js.publish(subject_for("telemetry", e["node"]), payload)
    middle = await _last_stored(bus, TELEMETRY) + timedelta(microseconds=1)
    later = [
        writer.encode(e["node"], from_rfc3339(e["ts"]), e["data"]["gpus"], e["id"])
        for e in telemetry[half:]
    ]
    assert not any(b"static" in p for p in later), "no keyframe after the middle"
    for e, payload in zip(telemetry[half:], later, strict=True):
        await bus.js.publish(subject_for("telemetry", e["node"]), payload)
    out = io.BytesIO()
    done = await export(bus.js, Selection(since=middle), out, 1)
    assert done.unjoined == 0 and done.total == len(later)
    for line, payload in zip(out.getvalue().splitlines(), later, strict=True):
        assert Telemetry.of(decode(line)).facts == book.telemetry(payload).facts  # type: ignore[arg-type]
    compact = io.BytesIO()
    await export(bus.js, Selection(since=middle), compact, 2)
    path = tmp_path / "later.jsonl"
    path.write_bytes(compact.getvalue())
    rules = load_rules([shipped.shipped("rules")], shipped.shipped("playbooks"))
    _, report = await replay(path, rules, None)
    assert report.events == len(later) and not report.refusals()
    for node in {e["node"] for e in telemetry}:
        await bus.buckets.facts.delete(node)
    lost = io.BytesIO()
    done = await export(bus.js, Selection(since=middle), lost, 1)
    assert done.unjoined == len(later) and done.total == 0, "not joined, not made up"
