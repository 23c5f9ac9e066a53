"""ChatOps over real HTTP on loopback: signed Slack and Mattermost commands, and refusals."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import urlencode

import aiohttp
import pytest
from gpuops.bus.conn import EVENTS, Bus
from gpuops.bus.server import EmbeddedNats
from gpuops.bus.store import NatsKV
from gpuops.decide.silence import SilenceStore
from gpuops.http import HttpServer
from gpuops.ops.chatops import slack_signature
from gpuops.ops.commands import COMMANDS, help_text
from gpuops.record.audit import read_audit
from gpuops.record.metrics import total
from gpuops.sim.fleet import SimFleet
from gpuops.spine.app import App
from prometheus_client import CollectorRegistry

from tests.conftest import engine_settings, running_engine, wait_for

pytestmark = pytest.mark.integration
SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
TOKEN = "mm-token-123-4567-89ab-cdef"  # Mattermost makes 26-character ones
TEAM = "T0TEAM"
USER_IDS = {"alice": "U0ALICE", "mallory": "U0MALLORY"}
ALICE = f"slack:{TEAM}/U0ALICE"


@pytest.fixture
async def engine(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> AsyncIterator[App]:
    settings = engine_settings(
        tmp_path,
        fleet,
        nats_server.url,
        http="127.0.0.1:0",
        chatops={
            "slack_signing_secret": SECRET,
            "mattermost_tokens": [TOKEN],
            "permissions": {
                "silence": {"users": [ALICE], "channels": ["gpu-ops"]},
                "dry-run": {"users": [ALICE]},
                "drain": {"users": [ALICE]},
            },
        },
    )
    async with running_engine(settings, bus) as app:
        await wait_for(lambda: app.http_port > 0, 10)
        yield app


async def _slack(
    app: App,
    text: str,
    user: str = "alice",
    channel: str = "gpu-ops",
    ts: float | None = None,
    secret: str = SECRET,
    sign: bool = True,
) -> tuple[int, dict]:
    body = urlencode(
        {
            "command": "/gpuops",
            "text": text,
            "team_id": TEAM,
            "user_id": USER_IDS[user],
            "user_name": user,
            "channel_name": channel,
        }
    ).encode()
    stamp = str(int(ts if ts is not None else time.time()))
    headers = {"Content-Type": "application/x-www-form-urlencoded"}
    if sign:
        headers |= {
            "X-Slack-Request-Timestamp": stamp,
            "X-Slack-Signature": slack_signature(secret, stamp, body),
        }
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"http://127.0.0.1:{app.http_port}/chatops/slack", data=body, headers=headers
        ) as reply,
    ):
        return reply.status, await reply.json()


async def test_valid_slack_command_runs(engine: App) -> None:
    status, body = await _slack(engine, "status")
    assert (
        status == 200 and "nodes: healthy 2" in body["text"] and "breaker: closed" in body["text"]
    )
    status, body = await _slack(engine, "silence node:node-001 30m 'fan swap'")
    assert status == 200 and body["text"].startswith("silence ")
    silences = await SilenceStore(NatsKV(engine.bus.kv["control"])).all()
    assert [(s.target, s.reason, s.by) for s in silences] == [("node:node-001", "fan swap", ALICE)]


async def test_forged_stale_and_unsigned_slack_requests_get_401_and_are_counted(
    engine: App,
) -> None:
    assert await _slack(engine, "status", secret="not-the-secret") == (
        401,
        {"error": "bad_signature"},
    )
    assert await _slack(engine, "status", ts=time.time() - 600) == (
        401,
        {"error": "stale_timestamp"},
    )
    assert await _slack(engine, "status", sign=False) == (401, {"error": "unsigned"})
    metrics = await _get(engine, "/metrics")
    for reason in ("bad_signature", "stale_timestamp", "unsigned"):
        assert f'gpuops_chatops_rejections_total{{reason="{reason}"}} 1.0' in metrics
    records = [r async for r in read_audit(engine.bus.js)]
    notes = [r.body["rejected"] for r in records if "rejected" in r.summary]
    assert notes == [{"bad_signature": 1}], "one summary now, the rest within the interval"
    assert not any(SECRET in r.model_dump_json() for r in records), "no secret in the audit trail"


async def test_user_without_permission_is_refused_with_why(engine: App) -> None:
    status, body = await _slack(engine, "silence node:node-001 1h x", user="mallory")
    mallory = f"slack:{TEAM}/U0MALLORY (mallory)"
    assert status == 200 and body["text"] == f"refused: {mallory} may not run 'silence'"
    status, body = await _slack(engine, "silence node:node-001 1h x", channel="random")
    assert body["text"] == "refused: 'silence' may not be run in channel 'random'"
    status, body = await _slack(engine, "breaker reset")
    assert body["text"] == "refused: 'breaker' is not granted to anyone in settings"
    assert await SilenceStore(NatsKV(engine.bus.kv["control"])).all() == []


async def test_mattermost_token_and_trigger_word(engine: App) -> None:
    url = f"http://127.0.0.1:{engine.http_port}/chatops/mattermost"
    async with aiohttp.ClientSession() as session:
        ok = await session.post(
            url,
            data={
                "token": TOKEN,
                "text": "gpuops status",
                "trigger_word": "gpuops",
                "team_id": "kwoknj9nwp",
                "user_id": "rnina9994b",
                "user_name": "bob",
                "channel_name": "town-square",
            },
        )
        assert ok.status == 200 and "breaker: closed" in (await ok.json())["text"]
        missing = await session.post(url, data={"text": "status"})
        assert missing.status == 401
        wrong = await session.post(url, json={"token": "guess", "text": "status"})
        assert wrong.status == 401


async def test_commands_become_chatops_events_and_metrics_and_health(engine: App) -> None:
    await _slack(engine, "dry-run on")
    m = engine.engine.metrics
    await wait_for(lambda: total(m.events, "chatops") >= 1, 10)
    await wait_for(lambda: engine.engine.stores.dry_run.on, 10)
    metrics = await _get(engine, "/metrics")
    assert 'gpuops_events_total{kind="chatops"}' in metrics
    assert "gpuops_breaker_open" in metrics
    assert "gpuops_chatops_rejections_total" in metrics
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{engine.http_port}/healthz") as health,
    ):
        assert (health.status, await health.json()) == (200, {"status": "ok"})


async def test_healthz_says_degraded_and_why() -> None:
    server = HttpServer(CollectorRegistry(), lambda: (False, {"nats": "not connected"}))
    port = await server.start("127.0.0.1:0")
    try:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/healthz") as health,
        ):
            body = await health.json()
    finally:
        await server.stop()
    assert (health.status, body) == (503, {"status": "degraded", "why": {"nats": "not connected"}})


async def test_drain_from_chat_is_decided_by_the_engine_and_runs_on_that_node(
    engine: App, fleet: SimFleet
) -> None:
    status, body = await _slack(engine, "drain node-002 'bad fan'")
    assert (status, body["text"]) == (
        200,
        "drain of node-002 requested: bad fan (the engine decides; see `status`)",
    )
    await wait_for(lambda: fleet.state("node-002")["drained"], 30)
    assert f"bad fan (by {ALICE})" in fleet.state("node-002")["drain_reason"]
    assert not fleet.state("node-001")["drained"]
    records = [r async for r in read_audit(engine.bus.js, "node-002")]
    assert any(r.type == "decision" and r.rule == "chatops-drain" for r in records), (
        "a decision through the stages, not an intent written by the command"
    )


async def test_a_refused_or_malformed_drain_requests_nothing(engine: App) -> None:
    refused = await _slack(engine, "drain node-002 x", user="mallory")
    assert refused[1]["text"] == f"refused: slack:{TEAM}/U0MALLORY (mallory) may not run 'drain'"
    no_reason = await _slack(engine, "drain node-002")
    assert no_reason[1]["text"] == "drain: missing arguments (usage: drain NODE REASON)"
    unknown = await _slack(engine, "drain node-999 x")
    assert unknown[1]["text"].startswith("drain: 'node-999' is not in the inventory")
    info = await engine.bus.js.stream_info(EVENTS, subjects_filter="gpuops.events.*.chatops.>")
    assert not info.state.subjects, "no chatops event, so the engine has nothing to act on"


async def test_help_lists_the_command_table(engine: App) -> None:
    _, body = await _slack(engine, "help")
    assert body["text"] == help_text()
    assert all(c.usage in body["text"] for c in COMMANDS.values())


async def _get(app: App, path: str) -> str:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{app.http_port}{path}") as reply,
    ):
        return await reply.text()
