"""Alertmanager as a source: a real Alertmanager delivers to a running engine's receiver.

The engine runs as role `engine` (no executor), so a decision ends as an intent in the
actions queue and nothing runs: what is asserted is the decision.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from gpuops.bus.conn import ACTIONS, Bus
from gpuops.bus.server import EmbeddedNats
from gpuops.intake.alertmanager import PATH
from gpuops.record.audit import read_audit
from gpuops.record.metrics import total
from gpuops.sim.fleet import SimFleet
from gpuops.spine.app import App

from tests.conftest import engine_settings, running_engine, wait_for
from tests.support import free_port

pytestmark = pytest.mark.integration
TOKEN = "am-engine-token-41c9-0123456789"
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
HOT = {"alertname": "GpuTemperatureHigh", "severity": "critical", "gpu": "2"}


@pytest.fixture
async def engine(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> AsyncIterator[App]:
    settings = engine_settings(
        tmp_path,
        fleet,
        nats_server.url,
        http="127.0.0.1:0",
        role="engine",
        sources={"alertmanager": {"token": TOKEN}},
    )
    async with running_engine(settings, bus) as app:
        await wait_for(lambda: app.http_port > 0, 10)
        yield app


async def decisions(bus: Bus, node: str, rule: str) -> list[dict[str, Any]]:
    """The decisions of a rule on a node (with the facts they saw), oldest first."""
    return [
        {**r.body["decision"], "facts": r.body["facts"]}
        async for r in read_audit(bus.js, node)
        if r.type == "decision" and r.rule == rule
    ]


async def resolved_notes(bus: Bus, node: str) -> list[str]:
    return [
        r.summary
        async for r in read_audit(bus.js, node)
        if r.type == "note" and r.summary.startswith("episode ") and " resolved: " in r.summary
    ]


def webhook(*alerts: dict[str, Any]) -> dict[str, Any]:
    return {"version": "4", "status": "firing", "receiver": "gpuops", "alerts": list(alerts)}


def am_alert(node: str, fingerprint: str) -> dict[str, Any]:
    return {
        "status": "firing",
        "labels": {**HOT, "instance": f"{node}:9400", "Hostname": node},
        "annotations": {},
        "startsAt": "2026-03-01T10:00:00Z",
        "endsAt": "0001-01-01T00:00:00Z",
        "fingerprint": fingerprint,
    }


async def post_engine(app: App, body: bytes | dict[str, Any]) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    url = f"http://127.0.0.1:{app.http_port}{PATH}"
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=data, headers=headers) as r,
    ):
        return r.status, await r.json()


async def test_the_engine_decides_a_posted_alert_once_and_survives_a_malformed_post(
    engine: App,
) -> None:
    bus = engine.bus
    assert (await post_engine(engine, b'{"version": "4", "alerts": [}'))[0] == 400
    status, reply = await post_engine(
        engine, webhook(am_alert("node-001", "a1"), am_alert("node-999", "a2"))
    )
    assert (status, reply) == (200, {"alerts": 2, "published": 2})
    await wait_for(lambda: decisions(bus, "node-001", "alert-gpu-temp-critical"), 20)
    [d] = await decisions(bus, "node-001", "alert-gpu-temp-critical")
    assert d["accepted"] and [a["playbook"] for a in d["actions"]] == ["drain.yml"]
    assert d["match"]["gpus"] == [2]
    # The repeat Alertmanager sends hours later is answered and not decided again.
    assert (await post_engine(engine, webhook(am_alert("node-001", "a1"))))[1] == {
        "alerts": 1,
        "duplicate": 1,
    }
    # A host outside the inventory is never acted upon.
    await wait_for(lambda: total(engine.engine.metrics.unknown_nodes) >= 1, 10)
    assert await decisions(bus, "node-999", "alert-gpu-temp-critical") == []
    assert total(engine.engine.metrics.events, "alert") == 2
    assert len(await decisions(bus, "node-001", "alert-gpu-temp-critical")) == 1
    info = await bus.js.stream_info(ACTIONS)
    assert info.state.messages == 1, "one drain intent, for node-001"
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{engine.http_port}/healthz") as r,
    ):
        assert r.status == 200


@contextlib.contextmanager
def alertmanager(tmp_path: Path, webhook_url: str) -> Iterator[str]:
    """A real Alertmanager on a random port, routing every alert to `webhook_url`."""
    assert ALERTMANAGER is not None
    config = {
        "route": {
            "receiver": "gpuops",
            "group_by": ["alertname", "instance"],
            "group_wait": "0s",
            "group_interval": "1s",
            "repeat_interval": "1h",
        },
        "receivers": [
            {
                "name": "gpuops",
                "webhook_configs": [
                    {
                        "url": webhook_url,
                        "send_resolved": True,
                        "max_alerts": 1000,
                        "http_config": {"authorization": {"type": "Bearer", "credentials": TOKEN}},
                    }
                ],
            }
        ],
    }
    home = tmp_path / "alertmanager"
    home.mkdir()
    (home / "alertmanager.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = (home / "log").open("w")
    proc = subprocess.Popen(
        [
            ALERTMANAGER,
            f"--config.file={home / 'alertmanager.yml'}",
            f"--storage.path={home / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


async def _ready(url: str) -> bool:
    with contextlib.suppress(aiohttp.ClientError):
        async with aiohttp.ClientSession() as session, session.get(f"{url}/-/ready") as r:
            return r.status == 200
    return False


async def _post_alerts(url: str, alerts: list[dict[str, Any]]) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{url}/api/v2/alerts", json=alerts) as r,
    ):
        assert r.status == 200, await r.text()


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


@pytest.mark.skipif(
    ALERTMANAGER is None,
    reason="prometheus-alertmanager is not installed (scripts/ci-setup.sh installs it)",
)
async def test_a_real_alertmanager_delivers_alerts_the_engine_decides_and_resolves(
    tmp_path: Path, engine: App
) -> None:
    bus = engine.bus
    hook = f"http://127.0.0.1:{engine.http_port}{PATH}"
    with alertmanager(tmp_path, hook) as am:
        await wait_for(lambda: _ready(am), 15)
        started = _iso(time.time())
        known = {"labels": {**HOT, "instance": "node-001:9400"}, "startsAt": started}
        stranger = {"labels": {**HOT, "instance": "node-999:9400"}, "startsAt": started}
        await _post_alerts(am, [known, stranger])
        await wait_for(lambda: decisions(bus, "node-001", "alert-gpu-temp-critical"), 20)
        [d] = await decisions(bus, "node-001", "alert-gpu-temp-critical")
        assert d["accepted"] and [a["playbook"] for a in d["actions"]] == ["drain.yml"]
        assert d["facts"]["labels"]["instance"] == "node-001:9400"
        await wait_for(lambda: total(engine.engine.metrics.unknown_nodes) >= 1, 10)
        assert await decisions(bus, "node-999", "alert-gpu-temp-critical") == []
        # The GPU cooled: Alertmanager sends the resolution, which closes the episode.
        await _post_alerts(am, [{**known, "endsAt": _iso(time.time())}])
        await wait_for(lambda: resolved_notes(bus, "node-001"), 20)
    [note] = await resolved_notes(bus, "node-001")
    assert note.startswith("episode alert-gpu-temp-critical@node-001:")
    assert "resolved: the condition cleared" in note
    assert len(await decisions(bus, "node-001", "alert-gpu-temp-critical")) == 1
    assert total(engine.engine.metrics.events, "alert") == 3  # two firing, one resolved
