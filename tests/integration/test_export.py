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
from gpuops.match.loader import load_rules
from gpuops.models import subject_for
from gpuops.ops.export import Selection, _read, export
from gpuops.settings import NatsSettings
from gpuops.spine.replay import replay_file

from tests.support import gpuops_argv

pytestmark = pytest.mark.integration
RECORDING = shipped.shipped("examples") / "recording.jsonl"


def _recorded() -> list[dict[str, Any]]:
    return [json.loads(line) for line in RECORDING.read_text().splitlines()]


async def _publish(bus: Bus, events: list[dict[str, Any]]) -> None:
    for event in events:
        await bus.js.publish(subject_for(event["kind"], event["node"]), json.dumps(event).encode())


async def _export(bus: Bus, selection: Selection) -> list[dict[str, Any]]:
    out = io.BytesIO()
    await export(bus.js, selection, out)
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
    read = [json.loads(payload)["id"] for _, _, payload in [first, *rest]]
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
