"""The agent on a real nats-server: health events spool while NATS is down and flush in order."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import nats
import pytest
from gpuops.agent.agent import Agent, AgentSettings
from gpuops.agent.nvml import NvmlBackend
from gpuops.agent.probe import run_probe
from gpuops.bus.conn import EVENTS, ensure_streams
from gpuops.bus.server import EmbeddedNats
from gpuops.clock import SystemClock
from gpuops.models import EVENT_ADAPTER
from nats.aio.client import Client

from tests.conftest import ROOT, wait_for
from tests.fake_pynvml import FakeNvml

pytestmark = pytest.mark.integration


async def test_health_events_spool_while_nats_is_down_and_flush_in_order(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "nats").start()
    nc = await nats.connect(server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    await ensure_streams(nc.jetstream())
    settings = AgentSettings(node="node-001", spool_path=tmp_path / "spool.jsonl", spool_max=3)
    agent = Agent(settings, NvmlBackend(FakeNvml()), nc, SystemClock())
    try:
        await agent.publish_heartbeat()
        server.stop()
        await wait_for(lambda: not nc.is_connected, 10)
        for xid in (13, 31, 43, 48):  # four into a spool of three: the oldest is dropped
            await agent.publish_health("xid", {"gpu": 0, "xid": xid})
        assert len(agent.spool) == 3 and agent.spool.dropped == 1
        server = EmbeddedNats(tmp_path / "nats", port=server.port).start()
        await wait_for(lambda: nc.is_connected, 20)
        await agent.flush_spool()
        assert len(agent.spool) == 0
        js = nc.jetstream()
        info = await js.stream_info(EVENTS)
        kinds = [
            json.loads((await js.get_msg(EVENTS, seq)).data)
            for seq in range(1, info.state.last_seq + 1)
        ]
        assert [e["kind"] for e in kinds] == ["heartbeat", "xid", "xid", "xid"]
        assert [e["data"]["xid"] for e in kinds[1:]] == [31, 43, 48]
        await agent.publish_heartbeat()
        last = json.loads((await js.get_msg(EVENTS, info.state.last_seq + 1)).data)
        assert last["data"]["spool_dropped"] == 1, "the heartbeat reports what was dropped"
    finally:
        await nc.close()
        server.stop()


async def test_agent_loop_publishes_telemetry_heartbeat_and_listener_events(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "nats").start()
    nc = await nats.connect(server.url)
    await ensure_streams(nc.jetstream())
    fake = FakeNvml(gpus=2)
    from types import SimpleNamespace

    import pynvml

    fake.events.append(
        SimpleNamespace(eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=79, device=1)
    )
    settings = AgentSettings(
        node="node-001",
        interval_s=0.2,
        heartbeat_s=0.5,
        probe_every_s=3600,
        probe_command=("true",),
        spool_path=tmp_path / "spool.jsonl",
    )
    agent = Agent(settings, NvmlBackend(fake), nc, SystemClock())
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await wait_for(
            lambda: agent.sent.get("telemetry", 0) >= 2 and agent.sent.get("xid") == 1, 15
        )
        assert agent.sent.get("probe") == 2 and agent.sent.get("heartbeat", 0) >= 1
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await nc.close()
        server.stop()


def test_probe_without_a_gpu_library_is_unavailable_not_passed() -> None:
    result = run_probe([0], timeout_s=60)[0]
    assert result["outcome"] == "unavailable" and result["ok"] is False


def test_probe_command_failure_and_timeout() -> None:
    assert run_probe([0], 10, ["false"])[0]["outcome"] == "fail"
    assert run_probe([0], 0.5, ["sleep", "5"])[0]["outcome"] == "timeout"
    assert run_probe([3], 10, ["sh", "-c", "test {gpu} = 3"])[0]["outcome"] == "pass"


def test_agent_once_json_on_a_simulated_node(tmp_path: Path) -> None:
    from gpuops.sim.fleet import SimFleet

    fleet = SimFleet.create(tmp_path / "sim", nodes=1, gpus=2)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpuops.cli",
            "agent",
            "--once",
            "--json",
            "--backend",
            "sim",
            "--sim-root",
            str(fleet.root),
            "--node",
            "node-001",
            "--probe-command",
            "true",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    events = [EVENT_ADAPTER.validate_json(line) for line in done.stdout.splitlines()]
    assert [e.kind for e in events] == ["telemetry", "probe", "probe"]
    assert len(events[0].data.gpus) == 2  # type: ignore[union-attr]


async def test_agent_publishes_ib_events_and_kernel_log_errors_without_double_xids(
    tmp_path: Path,
) -> None:
    from types import SimpleNamespace

    import pynvml

    from tests.unit.agent.test_infiniband import make_port

    server = EmbeddedNats(tmp_path / "nats").start()
    nc = await nats.connect(server.url)
    await ensure_streams(nc.jetstream())
    fake = FakeNvml(gpus=2)
    fake.pci = {0: (0, 0x18, 0), 1: (0, 0x2A, 0)}
    fake.events.append(  # NVML's event path sees XID 79 on GPU 1; the kernel log will too
        SimpleNamespace(eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=79, device=1)
    )
    ib_root = tmp_path / "infiniband"
    make_port(ib_root, "mlx5_0", symbol_error=4)
    flapping = make_port(ib_root, "mlx5_1")
    make_port(ib_root, "mlx5_2", state="1: DOWN", phys="2: Polling")  # a spare, never up
    kmsg = tmp_path / "kmsg"
    os.mkfifo(kmsg)
    settings = AgentSettings(
        node="node-001",
        interval_s=0.2,
        heartbeat_s=3600,
        probe_every_s=3600,
        probe_command=("true",),
        spool_path=tmp_path / "spool.jsonl",
        ib_root=ib_root,
        kmsg_path=kmsg,
    )
    agent = Agent(settings, NvmlBackend(fake), nc, SystemClock())
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    try:
        await wait_for(lambda: agent.sent.get("xid") == 1, 15)  # NVML's, first
        await wait_for(lambda: agent.sent.get("ib") == 1, 15)  # all up but the spare
        (flapping / "state").write_text("1: DOWN\n")  # a port that was up goes down
        lines = (
            b"3,1,100,-;NVRM: Xid (PCI:0000:2a:00): 79, pid=1, GPU has fallen off the bus.\n"
            b"3,2,101,-;NVRM: Xid (PCI:0000:18:00): 13, Graphics SM Warp Exception\n"
            b"3,3,102,-;nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 24007, Fatal, Link 3\n"
            b"garbage without a kmsg prefix\n"
        )
        await asyncio.to_thread(kmsg.write_bytes, lines)  # opening blocks until the agent reads
        await wait_for(
            lambda: (
                agent.sent.get("xid") == 2
                and agent.sent.get("sxid") == 1
                and agent.sent.get("ib", 0) >= 2
            ),
            15,
        )
        await wait_for(lambda: _down_reported(nc, "mlx5_1/1"), 15)
        assert agent.xid_duplicates == 1 and agent.kmsg.stats.malformed == 1
        js = nc.jetstream()
        info = await js.stream_info(EVENTS)
        stored = [
            json.loads((await js.get_msg(EVENTS, seq)).data)
            for seq in range(1, info.state.last_seq + 1)
        ]
        xids = [
            (e["data"]["gpu"], e["data"]["xid"], e["source"]) for e in stored if e["kind"] == "xid"
        ]
        assert xids == [(1, 79, "agent"), (0, 13, "kmsg")]
        sxid = next(e for e in stored if e["kind"] == "sxid")
        assert sxid["source"] == "kmsg" and sxid["data"]["fatal"] is True
        ib = [EVENT_ADAPTER.validate_python(e) for e in stored if e["kind"] == "ib"]
        assert ib and all(e.source == "agent" for e in ib)
        assert ib[0].data.ports_down == 0 and ib[0].data.symbol_error == 4  # type: ignore[union-attr]
        # Another IB event (a counter moving) may come between: the down port's is there,
        # and no event names the spare.
        downs = [e.data.down_ports for e in ib]  # type: ignore[union-attr]
        assert ["mlx5_1/1"] in downs and all("mlx5_2/1" not in d for d in downs), downs
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        await nc.close()
        server.stop()


async def test_a_steady_healthy_ib_summary_is_not_repeated_every_interval(tmp_path: Path) -> None:
    from gpuops.clock import ManualClock

    from tests.unit.agent.test_infiniband import make_port

    server = EmbeddedNats(tmp_path / "nats").start()
    nc = await nats.connect(server.url)
    ib_root = tmp_path / "infiniband"
    port = make_port(ib_root, "mlx5_0")
    clock = ManualClock()
    settings = AgentSettings(
        node="node-001", spool_path=tmp_path / "spool.jsonl", ib_root=ib_root, ib_every_s=300
    )
    agent = Agent(settings, NvmlBackend(FakeNvml()), nc, clock)
    try:
        for _ in range(3):
            await agent.publish_ib()
            clock.advance(10)
        assert agent.sent["ib"] == 1, "unchanged and healthy: once"
        (port / "counters" / "symbol_error").write_text("7\n")
        await agent.publish_ib()
        assert agent.sent["ib"] == 2, "a counter moved: at once"
        (port / "state").write_text("1: DOWN\n")
        for _ in range(3):
            await agent.publish_ib()
            clock.advance(10)
        assert agent.sent["ib"] == 5, "a port down: every interval, so `for:` rules can hold"
        (port / "state").write_text("4: ACTIVE\n")
        await agent.publish_ib()
        clock.advance(310)
        await agent.publish_ib()
        assert agent.sent["ib"] == 7, "back up at once, then the keepalive after ib_every_s"
    finally:
        await nc.close()
        server.stop()


async def _down_reported(nc: Client, port: str) -> bool:
    """An IB event naming `port` down is stored."""
    js = nc.jetstream()
    last = (await js.stream_info(EVENTS)).state.last_seq
    for seq in range(1, last + 1):
        event = json.loads((await js.get_msg(EVENTS, seq)).data)
        if event["kind"] == "ib" and port in event["data"].get("down_ports", []):
            return True
    return False


async def test_the_agent_reports_a_narrowed_link_within_one_interval_and_not_an_idle_one(
    tmp_path: Path,
) -> None:
    """Issue 28's topology test on a real nats-server: node-002's GPU 3 at Gen5 x8 under
    load is a `topology` event on the agent's first sample; node-003, idle at Gen1 x16,
    says nothing; both against a manifest learnt from node-001."""
    from gpuops.agent.topology import observe
    from gpuops.diagnose.topology import dump, learned
    from gpuops.sim.fleet import SimFleet
    from gpuops.sim.nodebackend import SimBackend

    fleet = SimFleet.create(tmp_path / "sim", nodes=3, gpus=8)
    good = SimBackend(fleet.root, "node-001")
    seen = observe(
        good.sample()[0],
        good.pci_bus_ids(),
        fleet.node_dir("node-001") / "sys",
        None,
        None,
        maxima=True,
    )
    manifest = tmp_path / "h200-8gpu.yml"
    manifest.write_text(dump(learned(seen, "node-001", "h200-8gpu", "t")))
    fleet.inject("node-002", "pcie_narrow", 3, width=8)
    fleet.inject("node-002", "load", 0, workload="training")
    fleet.inject("node-003", "load", 0, workload="idle")
    server = EmbeddedNats(tmp_path / "nats").start()
    nc = await nats.connect(server.url)
    try:
        await ensure_streams(nc.jetstream())
        for node in ("node-002", "node-003"):
            settings = AgentSettings(
                node=node,
                spool_path=tmp_path / f"{node}.jsonl",
                topology=manifest,
                sys_root=fleet.node_dir(node) / "sys",
            )
            agent = Agent(settings, SimBackend(fleet.root, node), nc, SystemClock())
            await agent.publish_telemetry()  # the first interval
            await agent.publish_telemetry()  # within topology_every_s: not again
        info = await nc.jetstream().stream_info(EVENTS)
        events = [
            EVENT_ADAPTER.validate_json((await nc.jetstream().get_msg(EVENTS, seq)).data)
            for seq in range(1, info.state.last_seq + 1)
        ]
    finally:
        await nc.close()
        server.stop()
    found = [(e.node, e.data.check, e.data.gpu, e.data.expected, e.data.actual) for e in events]
    assert found == [("node-002", "pcie_width", 3, 16, 8)], found
