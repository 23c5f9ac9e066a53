"""What a node's page says of its faults, on a running engine read over HTTP: the GPU a
fault is about, repeated drops folded into one line, the strongest fault first."""

from __future__ import annotations

import json
import re
from pathlib import Path

import aiohttp
import pytest
from gpuops.bus.conn import Bus
from gpuops.bus.server import EmbeddedNats
from gpuops.models import new_event, subject_for
from gpuops.record.audit import read_audit
from gpuops.sim.fleet import SimFleet
from gpuops.spine.app import App

from tests.conftest import engine_settings, running_engine, wait_for
from tests.support import as_node

pytestmark = pytest.mark.integration


async def _xid(app: App, bus: Bus, node: str, gpu: int, xid: int = 79) -> None:
    """An XID as the node's agent reports it (signed as that node)."""
    event = new_event("xid", node, app.clock.now(), {"gpu": gpu, "xid": xid}, "agent")
    payload = json.dumps(event).encode()
    subject = subject_for("xid", node)
    await bus.js.publish(subject, payload, headers=as_node(app.keys, subject, payload))


async def _decisions(bus: Bus, node: str, rule: str) -> int:
    found = [r async for r in read_audit(bus.js, node) if r.type == "decision" and r.rule == rule]
    return len(found)


def _lines(html: str, kind: str) -> list[str]:
    """The timeline's lines of one kind, as the page has them."""
    return re.findall(rf'<li class="entry kind-{kind}".*?</li>', html, re.S)


async def test_a_fault_line_names_the_gpu_it_is_about(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    settings = engine_settings(tmp_path, fleet, nats_server.url, http="127.0.0.1:0")
    async with running_engine(settings, bus) as app:
        await wait_for(lambda: app.http_port, 30)
        await _xid(app, bus, "node-001", 3)

        async def decided() -> bool:
            return await _decisions(bus, "node-001", "xid-79-gpu-lost") > 0

        await wait_for(decided, 30)
        url = f"http://127.0.0.1:{app.http_port}/console/node/node-001"
        async with aiohttp.ClientSession() as http, http.get(url) as r:
            html = await r.text()
    [fault] = [line for line in _lines(html, "fault") if 'data-rule="xid-79-gpu-lost"' in line]
    assert '<span class="gpus">GPU 3</span>' in fault, fault
