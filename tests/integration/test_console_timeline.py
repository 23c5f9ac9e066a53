"""What a node's page says of its faults, on a running engine read over HTTP: the GPU a
fault is about, repeated drops folded into one line, the strongest fault first."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import aiohttp
import pytest
from gpuops.bus.conn import Bus
from gpuops.bus.server import EmbeddedNats
from gpuops.clock import ScaledClock
from gpuops.decide.breaker import BreakerState
from gpuops.models import new_event, subject_for
from gpuops.record.audit import read_audit
from gpuops.record.episodes import read_open
from gpuops.sim.fleet import SimFleet
from gpuops.spine.app import App

from tests.conftest import engine_settings, running_engine, wait_for
from tests.support import as_node

pytestmark = pytest.mark.integration


async def _report(app: App, bus: Bus, node: str, kind: str, data: dict[str, object]) -> None:
    """An event as the node's agent reports it (signed as that node)."""
    event = new_event(kind, node, app.clock.now(), data, "agent")
    payload = json.dumps(event).encode()
    subject = subject_for(kind, node)
    await bus.js.publish(subject, payload, headers=as_node(app.keys, subject, payload))


async def _xid(app: App, bus: Bus, node: str, gpu: int, xid: int = 79) -> None:
    await _report(app, bus, node, "xid", {"gpu": gpu, "xid": xid})


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


@pytest.mark.slow  # a storm of the same drop through a running engine: `make test-slow`
async def test_the_same_drop_again_and_again_is_one_line_of_the_timeline(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    # A clock 30 times the wall's: the recorder writes a repeated drop once a minute of it,
    # so four XIDs 2.2 s (66 s of the clock) apart are four drop records in a row. The
    # agent beats with each, so its silence is no line between them.
    settings = engine_settings(tmp_path, fleet, nats_server.url, http="127.0.0.1:0")
    async with running_engine(settings, bus, ScaledClock(30.0)) as app:
        await wait_for(lambda: app.http_port, 30)
        await app.engine.breaker.set_state(BreakerState.OPEN, "test storm", app.clock.now(), "t")
        for n in range(1, 5):
            await _report(app, bus, "node-001", "heartbeat", {"seq": n})
            await _xid(app, bus, "node-001", 3)

            async def recorded(n: int = n) -> bool:
                return await _decisions(bus, "node-001", "xid-79-gpu-lost") >= n

            await wait_for(recorded, 30)
            await asyncio.sleep(2.2)
        url = f"http://127.0.0.1:{app.http_port}/console/node/node-001"
        async with aiohttp.ClientSession() as http, http.get(url) as r:
            html = await r.text()
    drops = [line for line in _lines(html, "drop") if 'data-rule="xid-79-gpu-lost"' in line]
    assert len(drops) == 1, drops
    assert "&times;4" in drops[0] and "dropped 4 times, first " in drops[0], drops[0]
    assert "breaker_open" in drops[0] and "GPU 3" in drops[0], drops[0]


async def test_a_node_whose_gpu_fell_off_the_bus_says_so_before_its_silent_agent(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    # node-002 loses GPU 1 (XID 79) while the breaker holds every reboot back, and its
    # agent goes silent (90 s of a clock 30 times the wall's): the silence moved the node
    # to suspect, the XID is the fault.
    settings = engine_settings(tmp_path, fleet, nats_server.url, http="127.0.0.1:0")
    async with running_engine(settings, bus, ScaledClock(30.0)) as app:
        await wait_for(lambda: app.http_port, 30)
        await app.engine.breaker.set_state(BreakerState.OPEN, "test storm", app.clock.now(), "t")
        await _xid(app, bus, "node-002", 1)

        async def silent_and_lost() -> bool:
            record = await app.engine.stores.states.get("node-002")
            rules = {ep.rule for ep in await read_open(app.engine.stores.episodes)}
            return record.why.startswith("agent-silent") and "xid-79-gpu-lost" in rules

        await wait_for(silent_and_lost, 30)
        base = f"http://127.0.0.1:{app.http_port}/console"
        async with aiohttp.ClientSession(base + "/") as http:
            async with http.get("node/node-002") as r:
                node_page = await r.text()
            async with http.get("now") as r:
                now_page = await r.text()
    why = re.search(r'<p class="why">(.*?)</p>', node_page, re.S)
    assert why is not None
    assert ": xid-79-gpu-lost on GPU 1 (critical); also agent-silent" in why.group(1), why.group(1)
    row = re.search(r'<tr><td><a href="/console/node/node-002">.*?</tr>', now_page, re.S)
    assert row is not None and "xid-79-gpu-lost on GPU 1 (critical)" in row.group(0), now_page
