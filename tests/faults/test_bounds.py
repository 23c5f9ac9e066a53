"""Issue 10, defects 7 and 8: oversized fields and made-up hosts are bounded.

A decision about an XID whose driver message is 200 KB (nearly all an event may
hold: a longer one is `too_large`, tests/faults/test_sizes.py) is still recorded (the
field cut at the intake, its hash kept in the cut's marker), and 5,000 heartbeats
from hosts outside the inventory leave no per-host state and a handful of audit notes,
not thousands.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest
from gpuops.bus.conn import AUDIT, Bus
from gpuops.bus.identity import KeyRing
from gpuops.bus.server import EmbeddedNats
from gpuops.models import new_event, subject_for
from gpuops.record.audit import read_audit
from gpuops.sim.fleet import SimFleet

from tests.conftest import counted, engine_settings, running_engine, wait_for
from tests.support import as_node

pytestmark = pytest.mark.faults


async def _send(bus: Bus, keys: KeyRing, kind: str, node: str, data: dict[str, object]) -> None:
    """Publish one event, signed as the node's agent (a made-up host's too: the engine
    must refuse it for not being in the inventory, not for its signature)."""
    event = new_event(kind, node, time.time(), data, "test")
    subject, payload = subject_for(kind, node), json.dumps(event).encode()
    await bus.js.publish(subject, payload, headers=as_node(keys, subject, payload, event["id"]))


async def test_a_huge_xid_message_is_recorded_cut_with_its_hash(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    message = "NVRM: Xid (PCI:0000:18:00): 13, " + "x" * 200_000
    settings = engine_settings(tmp_path, fleet, nats_server.url, role="engine")
    async with running_engine(settings, bus) as app:
        for _ in range(2):  # the rule wants it twice within a day
            await _send(bus, app.keys, "xid", "node-001", {"gpu": 0, "xid": 13, "message": message})
        await wait_for(lambda: counted(app.engine.metrics.decisions) >= 1, 30)

        async def recorded() -> list[dict[str, object]]:
            return [r.body async for r in read_audit(bus.js, "node-001") if r.type == "decision"]

        await wait_for(recorded, 30)
    (body,) = await recorded()
    facts = body["facts"]
    assert isinstance(facts, dict)
    digest = hashlib.sha256(message.encode()).hexdigest()
    assert facts["message"].startswith(message[:1000])
    assert facts["message"].endswith(f" chars, sha256 {digest}]")
    assert len(json.dumps(body)) < 64 * 1024, "the record stays small"
    info = await bus.js.stream_info(AUDIT)
    assert info.state.bytes < 512 * 1024


async def test_heartbeats_from_5000_made_up_hosts_leave_no_state(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    settings = engine_settings(tmp_path, fleet, nats_server.url, role="engine")
    async with running_engine(settings, bus) as app:
        windows_before = app.engine.matcher.state_size()
        for i in range(5000):
            await _send(bus, app.keys, "heartbeat", f"ghost-{i:05d}", {"seq": i})
        await wait_for(lambda: counted(app.engine.metrics.unknown_nodes) == 5000, 120)
        assert app.engine.matcher.state_size() == windows_before, "no window for a ghost"
        assert len(app.engine.pipeline._unknown) <= 1001, "the summary is bounded"
    notes = [r async for r in read_audit(bus.js) if "not in the inventory" in r.summary]
    assert 1 <= len(notes) <= 3, "summarised, not one note per host"
    assert [r async for r in read_audit(bus.js, "ghost-00001")] == []
