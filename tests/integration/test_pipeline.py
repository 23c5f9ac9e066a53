"""The whole pipeline on a real nats-server and real ansible-runner against simulated nodes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from gpuops.bus.conn import ACTIONS, DLQ, Bus
from gpuops.bus.identity import KeyRing
from gpuops.bus.server import EmbeddedNats
from gpuops.clock import SystemClock
from gpuops.ops.commands import Commands, render_status
from gpuops.record.audit import read_audit
from gpuops.settings import ChatopsSettings
from gpuops.sim.fleet import SimFleet, envelope

from tests.conftest import (
    calls,
    counted,
    engine_settings,
    run_outcomes,
    running_engine,
    wait_for,
)
from tests.support import as_node, node_keys

pytestmark = pytest.mark.integration


def _observations(histogram: Any) -> float:
    """How many values a histogram child took (its buckets are kept per bucket)."""
    return float(sum(b.get() for b in histogram._buckets))


async def _publish(bus: Bus, keys: KeyRing, event: dict) -> None:
    """Publish `event` as its node's agent would: signed as that node."""
    kind, node = event["kind"], event["node"]
    subject = f"gpuops.telemetry.{node}" if kind == "telemetry" else f"gpuops.events.{kind}.{node}"
    payload = json.dumps(event).encode()
    await bus.js.publish(subject, payload, headers=as_node(keys, subject, payload, event["id"]))


def _hot_sample(fleet: SimFleet, node: str, t: float, gpu: int, **over: float) -> dict:
    event = fleet.telemetry(node, t)
    assert event is not None
    event["data"]["gpus"][gpu].update(over)
    return event


async def test_overheat_and_low_power_limit_run_their_playbooks(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    settings = engine_settings(tmp_path, fleet, nats_server.url)
    fleet.inject("node-002", "power_limit", 1, watts=400)
    async with running_engine(settings, bus) as app:
        now = time.time()
        for second in range(-70, 1, 5):  # 70 s of samples, ending now
            t = now + second
            await _publish(bus, app.keys, _hot_sample(fleet, "node-001", t, 3, temp_c=88.0))
            await _publish(bus, app.keys, _hot_sample(fleet, "node-002", t, 1))
        await wait_for(lambda: counted(app.engine.metrics.runs) >= 2, 60)
        decided = app.engine.metrics.event_to_decision.labels("gpu-overheat")
        assert _observations(decided) >= 1, "event-to-decision observed per decision"
        # People see the fault as one open episode, not the samples behind it.
        status = await Commands.over_bus(bus, SystemClock(), None, ChatopsSettings()).status()
        [hot] = [e for e in status["episodes"] if e["rule"] == "gpu-overheat"]
        assert hot["node"] == "node-001" and hot["gpus"] == [3] and hot["decided_at"]
        assert "open episodes: " in render_status(status)
        # The GPU cools: the episode resolves, timed, and says so in the audit.
        await _publish(bus, app.keys, _hot_sample(fleet, "node-001", time.time(), 3, temp_c=40.0))
        await wait_for(
            lambda: app.engine.metrics.detect_to_recover.labels("gpu-overheat")._sum.get() > 0, 30
        )

    notes = [r.summary async for r in read_audit(bus.js, "node-001") if r.type == "note"]
    [resolved] = [
        n for n in notes if n.startswith("episode gpu-overheat@node-001") and "resolved" in n
    ]
    episode = resolved.split()[1]  # "episode RULE@NODE:OPENED resolved: ..."
    drains = calls(fleet, "node-001", "scontrol")
    # Slurm's reason names gpuops, the rule and the very episode the engine recorded.
    assert [
        "update",
        "nodename=node-001",
        "state=drain",
        f"reason=gpuops gpu-overheat {episode}: GPU 3 at 88.0 C",
    ] in drains
    assert ["-i", "1", "-pl", "700.0"] in calls(fleet, "node-002", "nvidia-smi")
    assert fleet.state("node-001")["drained"] is True
    assert fleet.state("node-002")["gpus"][1]["power_limit_w"] == 700.0
    outcomes = {o.playbook: o for o in await run_outcomes(bus)}
    assert outcomes["drain.yml"].status == "successful"
    assert len(outcomes["power_limit.yml"].sha256 or "") == 64
    assert outcomes["power_limit.yml"].stats["node-002"]["changed"] >= 1
    assert calls(fleet, "node-002", "scontrol") == [], "nothing ran on the wrong host"


async def test_malformed_event_goes_to_dead_letters_and_engine_keeps_going(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    settings = engine_settings(tmp_path, fleet, nats_server.url)
    async with running_engine(settings, bus) as app:
        # Both signed by the node their subject names: each is refused for its own reason.
        subject = "gpuops.events.xid.node-001"
        garbled = b"{this is not json"
        await bus.js.publish(subject, garbled, headers=as_node(app.keys, subject, garbled))
        elsewhere = json.dumps(envelope("xid", "node-002", time.time(), {"gpu": 0, "xid": 79}))
        payload = elsewhere.encode()
        await bus.js.publish(subject, payload, headers=as_node(app.keys, subject, payload))
        await _publish(bus, app.keys, envelope("heartbeat", "node-001", time.time(), {"seq": 1}))
        await wait_for(lambda: counted(app.engine.metrics.events, "heartbeat") == 1, 20)

    dlq = await bus.js.stream_info(DLQ)
    assert dlq.state.messages == 2
    first = json.loads((await bus.js.get_msg(DLQ, 1)).data)
    second = json.loads((await bus.js.get_msg(DLQ, 2)).data)
    assert first["reason"] == "json" and first["payload"] == "{this is not json"
    assert second["reason"] == "subject_mismatch"
    assert (await bus.js.get_msg(DLQ, 1)).subject == "gpuops.dlq.json"
    assert calls(fleet, "node-002") == [], "the event on the wrong subject was not acted upon"


async def test_event_about_unknown_host_is_recorded_never_acted_upon(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    settings = engine_settings(tmp_path, fleet, nats_server.url)
    async with running_engine(settings, bus) as app:
        await _publish(
            bus, app.keys, envelope("xid", "node-999", time.time(), {"gpu": 0, "xid": 79})
        )
        await wait_for(lambda: counted(app.engine.metrics.unknown_nodes) == 1, 20)
        await wait_for(lambda: _noted_unknown(bus, "node-999"), 20)
    assert [r async for r in read_audit(bus.js, "node-999")] == [], "nothing decided about it"
    assert await run_outcomes(bus) == []
    assert (await bus.js.stream_info(ACTIONS)).state.messages == 0


async def _engine_up(bus: Bus) -> bool:
    """Whether an engine process beat lately (what `gpuops status` reads)."""
    commands = Commands.over_bus(bus, SystemClock(), None, ChatopsSettings())
    return (await commands.engine(time.time())).running


def _engine(
    state: Path, url: str, fleet: SimFleet, role: str, **env: str
) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "gpuops.cli",
        "--state-dir",
        str(state),
        "run",
        "--nats",
        url,
        "--inventory",
        str(fleet.root / "inventory"),
        "--role",
        role,
    ]
    log = open(state.parent / f"engine-{role}.log", "ab")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})


async def test_crash_after_intent_runs_the_playbook_exactly_once(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    decider = _engine(state, nats_server.url, fleet, "engine")
    try:
        await wait_for(lambda: _engine_up(bus), 60)  # its heartbeat: up, consuming
        keys = node_keys(state)  # the identity key the engine made on starting
        await _publish(bus, keys, envelope("xid", "node-001", time.time(), {"gpu": 2, "xid": 79}))

        async def intent_stored() -> bool:
            return (await bus.js.stream_info(ACTIONS)).state.messages == 1

        await wait_for(intent_stored, 30)
    finally:
        decider.send_signal(signal.SIGKILL)  # no chance to run anything: the intent waits
        decider.wait()
    intent = (await bus.js.get_msg(ACTIONS, 1)).data
    assert calls(fleet, "node-001", "reboot") == []

    # Claims go stale after 8 s: a copy of an intent whose run is alive is looked at again
    # every 2 s, and acked as "not run again" once that run is done.
    worker = _engine(state, nats_server.url, fleet, "all", GPUOPS_RUN_CLAIM_STALE_S="8")
    try:
        await wait_for(lambda: len(calls(fleet, "node-001", "reboot")) == 1, 60)
        await bus.js.publish("gpuops.actions.node-001", intent, headers={"Nats-Msg-Id": "again"})

        async def skipped() -> bool:
            return any(["not run again" in r.summary async for r in read_audit(bus.js, "node-001")])

        await wait_for(skipped, 30)
    finally:
        worker.terminate()
        worker.wait(30)
    assert len(calls(fleet, "node-001", "reboot")) == 1
    runs = [r async for r in read_audit(bus.js, "node-001") if r.type == "run"]
    assert len(runs) == 1 and runs[0].body["status"] == "successful"
    assert runs[0].body["revision"], "the run records the playbook's git revision"
    assert runs[0].at >= json.loads(intent)["decided_at"], "run recorded after its decision"


async def _noted_unknown(bus: Bus, host: str) -> bool:
    return any(
        [r.type == "note" and host in r.body.get("hosts", {}) async for r in read_audit(bus.js)]
    )
