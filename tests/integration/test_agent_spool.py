"""The agent's spool on a real nats-server: what its file does must never stop the agent."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import nats
import pynvml
import pytest
from gpuops.agent.agent import Agent, AgentSettings
from gpuops.agent.nvml import NvmlBackend
from gpuops.bus.conn import EVENTS, ensure_streams
from gpuops.bus.server import EmbeddedNats
from gpuops.clock import SystemClock
from gpuops.models import new_event, subject_for
from nats.aio.client import Client

from tests.conftest import wait_for
from tests.fake_pynvml import FakeNvml

pytestmark = pytest.mark.integration

NODE = "node-001"


def _xid(gpu: int, xid: int) -> SimpleNamespace:
    """An XID as NVML's event set hands it to the agent's listener."""
    return SimpleNamespace(
        eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=xid, device=gpu
    )


def _agent(spool: Path, fake: FakeNvml, nc: Client) -> Agent:
    settings = AgentSettings(
        node=NODE,
        interval_s=0.2,
        heartbeat_s=0.2,
        probe_every_s=3600,
        probe_command=("true",),
        spool_path=spool,
    )
    return Agent(settings, NvmlBackend(fake), nc, SystemClock())


async def _stored(nc: Client) -> list[dict[str, Any]]:
    """Every event in the events stream, oldest first."""
    js = nc.jetstream()
    last = (await js.stream_info(EVENTS)).state.last_seq
    return [json.loads((await js.get_msg(EVENTS, seq)).data) for seq in range(1, last + 1)]


async def _xids_stored(nc: Client, at_least: int = 0) -> list[int]:
    """The stored XIDs; an empty list (false) while fewer than `at_least` are."""
    xids = [e["data"]["xid"] for e in await _stored(nc) if e["kind"] == "xid"]
    return xids if len(xids) >= at_least else []


async def test_a_torn_spool_line_is_skipped_and_the_agent_publishes_on(tmp_path: Path) -> None:
    held = new_event("xid", NODE, 1.0, {"gpu": 0, "xid": 48, "message": "DBE"}, "agent")
    line = json.dumps(
        {"subject": subject_for("xid", NODE), "payload": json.dumps(held), "msg_id": held["id"]}
    )
    spool = tmp_path / "spool.jsonl"
    spool.write_text(line + "\n" + line[:20] + "\n")  # the last write torn by a power cut
    server = EmbeddedNats(tmp_path / "nats").start()
    nc = await nats.connect(server.url)
    await ensure_streams(nc.jetstream())
    fake = FakeNvml(gpus=2)
    fake.events.append(_xid(1, 79))
    agent = _agent(spool, fake, nc)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await wait_for(lambda: agent.sent.get("heartbeat", 0) >= 2, 15)
        await wait_for(lambda: _xids_stored(nc, 2), 15)
        assert await _xids_stored(nc) == [48, 79], "the readable held event first, then the new"
        assert agent.spool.unreadable == 1 and agent.spool.dropped == 1
        assert len(spool.read_text().splitlines()) == 0, "the next write left out the torn line"
        assert not task.done()
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await nc.close()
        server.stop()


async def test_an_unwritable_spool_holds_events_in_memory_and_the_agent_runs_on(
    tmp_path: Path,
) -> None:
    spool = tmp_path / "spool.jsonl"
    spool.mkdir()  # a directory where the file should be: every read and write fails
    server = EmbeddedNats(tmp_path / "nats").start()
    nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    await ensure_streams(nc.jetstream())
    server.stop()
    await wait_for(lambda: not nc.is_connected, 10)
    fake = FakeNvml(gpus=2)
    agent = _agent(spool, fake, nc)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        fake.events.append(_xid(1, 79))  # while NATS is away: it must wait in the spool
        await wait_for(lambda: agent.spool.write_failures >= 1 and len(agent.spool) >= 1, 15)
        server = EmbeddedNats(tmp_path / "nats", port=server.port).start()
        await wait_for(lambda: nc.is_connected, 20)
        await wait_for(lambda: agent.sent.get("heartbeat", 0) >= 2, 15)
        await wait_for(lambda: _xids_stored(nc, 1), 15)
        assert await _xids_stored(nc) == [79]
        assert len(agent.spool) == 0 and not task.done()
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await nc.close()
        server.stop()
