"""Issue 31, item 1: a stored record that does not decode fails closed and is told.

Garbage written into a KV value the safety stages read (a cooldown, a lock, an attempt
history, a node state, the breaker, a silence, the dry-run switch) used to read as "no
such record": a garbage cooldown let a second reset through, a garbage breaker reopened,
a garbage dry-run switch turned a dry-run fleet live. Black box on a real nats-server,
with the engine and its executor running real ansible-runner against simulated nodes:
the garbage goes in before the XID that would act, and the XID must then act on nothing
the record guards, the drop naming bucket and key; a metric, `status` and the engine's
`state list` tell it; `state repair` shows it raw and rewrites it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import pytest
from gpuops.bus.conn import DLQ, Bus
from gpuops.bus.identity import KeyRing
from gpuops.bus.server import EmbeddedNats
from gpuops.bus.store import NatsKV
from gpuops.clock import SystemClock
from gpuops.models import new_event, subject_for
from gpuops.ops.cmdwire import ask_engine
from gpuops.ops.commands import Commands, render_status
from gpuops.record.audit import read_audit
from gpuops.scale.lag import drained, handled, lags
from gpuops.settings import ChatopsSettings, NatsSettings
from gpuops.sim.fleet import SimFleet

from tests.conftest import counted, engine_settings, run_outcomes, running_engine, wait_for
from tests.support import as_node

pytestmark = pytest.mark.faults

GARBAGE = b"\x00\xffnot a record{"
RULE = "xid-48-dbe"  # XID 48 -> gpu_reset.yml, cooldown 1 h, counts for the breaker
PARTITIONS = NatsSettings().partitions


def cooldown_key(node: str) -> str:
    """The cooldown record of xid-48-dbe on a node (it acts once per node, its GPUs
    covered inside the record: gpuops.decide.cooldown)."""
    return "cooldown." + hashlib.sha256(f"{RULE}|{node}".encode()).hexdigest()[:40]


async def publish_xid(bus: Bus, keys: KeyRing, node: str, gpu: int) -> str:
    """One XID 48, signed as its node's agent; its event id."""
    event = new_event("xid", node, time.time(), {"gpu": gpu, "xid": 48}, "test")
    subject, data = subject_for("xid", node), json.dumps(event).encode()
    await bus.js.publish(subject, data, headers=as_node(keys, subject, data, event["id"]))
    return str(event["id"])


async def decision(bus: Bus, event_id: str) -> dict[str, Any] | None:
    """The decision of xid-48-dbe on one event, once audited."""
    async for record in read_audit(bus.js):
        if record.type != "decision" or record.rule != RULE:
            continue
        if record.body["decision"]["match"]["event_id"] == event_id:
            return dict(record.body["decision"])
    return None


async def decided(bus: Bus, event_id: str) -> dict[str, Any]:
    await wait_for(lambda: decision(bus, event_id), 60)
    found = await decision(bus, event_id)
    assert found is not None
    return found


async def resets(bus: Bus, node: str) -> int:
    return sum(1 for o in await run_outcomes(bus, node) if o.playbook == "gpu_reset.yml")


async def status(bus: Bus) -> dict[str, Any]:
    return await Commands.over_bus(bus, SystemClock(), None, ChatopsSettings()).status()


async def all_counted(bus: Bus, published: int) -> None:
    """Every event published was decided (acked) or dead-lettered: none lost or stuck."""
    await wait_for(lambda: drained(bus.js, False, PARTITIONS), 60)
    dead = (await bus.js.stream_info(DLQ)).state.messages
    assert handled(await lags(bus.js, False, PARTITIONS)) == published
    assert dead == 0, "garbage state refuses no event: each is decided (dropped)"


# What each record guards: one node's (the other node still acts) or the fleet's.
PER_NODE = [
    ("cooldowns", lambda: cooldown_key("node-001"), "cooldown"),
    ("locks", lambda: "node.node-001", "lock"),
    ("history", lambda: "attempts.node-001", "attempt_cap"),
    ("nodes", lambda: "state.node-001", "node_record"),
]


@pytest.mark.slow  # a real reset on the other node per record: `make test-slow`
@pytest.mark.parametrize(("bucket", "key", "stage"), PER_NODE, ids=[p[0] for p in PER_NODE])
async def test_garbage_in_a_nodes_record_stops_actions_on_that_node_only(
    tmp_path: Path,
    bus: Bus,
    fleet: SimFleet,
    nats_server: EmbeddedNats,
    bucket: str,
    key: Any,
    stage: str,
) -> None:
    settings = engine_settings(tmp_path, fleet, nats_server.url)
    await NatsKV(bus.kv[bucket]).put(key(), GARBAGE)
    async with running_engine(settings, bus) as app:
        stopped = await decided(bus, await publish_xid(bus, app.keys, "node-001", 0))
        assert stopped["accepted"] is False and stopped["reason"] == "state_unreadable"
        assert stopped["detail"].startswith(f"{stage}: {bucket}/{key()} unreadable")
        # The rest of the fleet goes on: node-002's XID is reset.
        other = await decided(bus, await publish_xid(bus, app.keys, "node-002", 0))
        assert other["accepted"] is True
        await wait_for(lambda: resets(bus, "node-002"), 90)
        assert await resets(bus, "node-001") == 0, "nothing acted on node-001"
        assert counted(app.engine.metrics.state_unreadable, bucket) == 1
        lines = (await status(bus))["unreadable"]
        assert any(line.startswith(f"{bucket}/{key()}: unreadable") for line in lines)
        await all_counted(bus, 2)


async def test_a_garbage_cooldown_lets_no_second_reset_through_and_repair_restores_it(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    settings = engine_settings(tmp_path, fleet, nats_server.url)
    key = cooldown_key("node-001")
    async with running_engine(settings, bus) as app:
        # A reset ran an hour's cooldown ago... then its record was overwritten.
        await NatsKV(bus.kv["cooldowns"]).put(key, GARBAGE)
        first = await decided(bus, await publish_xid(bus, app.keys, "node-001", 0))
        assert first["reason"] == "state_unreadable"
        assert "cooldowns/" + key in first["detail"]
        listed = await ask_engine(bus, "state", ["list"])
        assert f"cooldowns/{key}: unreadable" in listed and "gpuops state repair" in listed
        shown = await ask_engine(bus, "state", ["repair", "cooldowns", key])
        assert "UNREADABLE as Firing" in shown and repr(GARBAGE)[2:12] in shown
        # A person puts the cooldown back as it was: started now, by the earlier event.
        firing = json.dumps({"at": time.time(), "event_id": "the-earlier-reset"})
        done = await ask_engine(bus, "state", ["repair", "cooldowns", key, "--set", firing])
        assert done.startswith(f"cooldowns/{key} set to")
        assert "decodes as Firing" in await ask_engine(bus, "state", ["repair", "cooldowns", key])
        again = await decided(bus, await publish_xid(bus, app.keys, "node-001", 0))
        assert again["reason"] == "cooldown", "the repaired cooldown holds the next XID"
        assert await ask_engine(bus, "state", ["list"]) == "no unreadable state"
        assert await resets(bus, "node-001") == 0
        # A record that reads is not rewritten through `state`: only one that does not.
        refused = await _refusal(bus, ["repair", "cooldowns", key, "--set", firing])
        assert "decodes as Firing: state repair mends only unreadable records" in refused
        # A value that is not the key's record is refused, and changes nothing.
        await NatsKV(bus.kv["cooldowns"]).put(key, GARBAGE)
        refused = await _refusal(bus, ["repair", "cooldowns", key, "--set", '{"at": "soon"}'])
        assert "not a Firing" in refused
        assert (await NatsKV(bus.kv["cooldowns"]).get(key)).value == GARBAGE  # type: ignore[union-attr]
        notes = [r.summary async for r in read_audit(bus.js) if r.type == "note"]
        assert any("state repair cooldowns" in n and "--set" in n for n in notes), "audited"
        await all_counted(bus, 2)


async def _refusal(bus: Bus, args: list[str]) -> str:
    try:
        await ask_engine(bus, "state", args)
    except Exception as exc:  # the engine's CommandError, as the CLI prints it
        return str(exc)
    raise AssertionError(f"state {args} was not refused")


async def test_a_garbage_breaker_keeps_automation_stopped(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    settings = engine_settings(tmp_path, fleet, nats_server.url)
    await NatsKV(bus.kv["control"]).put("breaker.fleet", GARBAGE)
    async with running_engine(settings, bus) as app:
        for node in fleet.nodes:
            stopped = await decided(bus, await publish_xid(bus, app.keys, node, 1))
            assert stopped["reason"] == "state_unreadable"
            assert stopped["detail"].startswith("breaker: control/breaker.fleet unreadable")
        metrics = app.engine.metrics
        await wait_for(lambda: metrics.breaker_open._value.get() == 1.0, 30)  # the tick's
        now = await status(bus)
        assert now["breaker"]["state"] == "open" and now["breaker"]["unreadable"] is True
        assert "breaker: open (its record is unreadable" in render_status(now)
        await all_counted(bus, len(fleet.nodes))
    assert sum([await resets(bus, n) for n in fleet.nodes]) == 0


async def test_a_garbage_silence_silences_everything_until_repaired(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    """One silence that cannot be read may cover any node: none is acted on."""
    settings = engine_settings(tmp_path, fleet, nats_server.url)
    await NatsKV(bus.kv["control"]).put("silence.0badc0de", GARBAGE)
    async with running_engine(settings, bus) as app:
        stopped = await decided(bus, await publish_xid(bus, app.keys, "node-002", 2))
        assert stopped["reason"] == "state_unreadable"
        assert stopped["detail"].startswith("silence: control/silence.0badc0de unreadable")
        gone = await ask_engine(bus, "state", ["repair", "control", "silence.0badc0de", "--delete"])
        assert "deleted" in gone
        await asyncio.sleep(2.5)  # the stage reads silences again every 2 s (refresh_s)
        after = await decided(bus, await publish_xid(bus, app.keys, "node-002", 3))
        assert after["accepted"] is True, "repaired: the fleet acts again"
        await wait_for(lambda: resets(bus, "node-002"), 90)


async def test_a_garbage_dry_run_switch_keeps_dry_run_on(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    settings = engine_settings(tmp_path, fleet, nats_server.url)
    async with running_engine(settings, bus) as app:
        await ask_engine(bus, "dry-run", ["on"])  # a person put the fleet in dry-run...
        await NatsKV(bus.kv["control"]).put("switch.dry_run", GARBAGE)  # ...then this
        await wait_for(lambda: app.engine.stores.unreadable.entries(), 10)
        held = await decided(bus, await publish_xid(bus, app.keys, "node-001", 0))
        assert held["reason"] == "dry_run", "decided, and not acted on"
        now = await status(bus)
        assert now["dry_run"] is True
        assert any(line.startswith("control/switch.dry_run") for line in now["unreadable"])
        await all_counted(bus, 2)  # the XID, and the `dry-run on` command's chatops event
    assert await resets(bus, "node-001") == 0
