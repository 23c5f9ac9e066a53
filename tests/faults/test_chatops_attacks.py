"""ChatOps as an attacker tries it (issue 10, defect 9; issue 25), over real HTTP on
loopback and a real nats-server: replays (to one engine and across engines sharing the
bus), impostors by name or by team, odd timestamps, a response_url pointing inward,
malformed Mattermost bodies, floods of unsigned requests, and Rich markup sent from chat."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import aiohttp
import pytest
from aiohttp import web
from gpuops.bus.conn import EVENTS, Bus, connect
from gpuops.bus.publish import JetStreamPublisher
from gpuops.bus.server import EmbeddedNats
from gpuops.bus.store import NatsKV
from gpuops.clock import ManualClock
from gpuops.decide.silence import SilenceStore
from gpuops.http import HttpServer
from gpuops.inventory.hosts import load_inventory
from gpuops.ops.chatops import Chatops, slack_signature
from gpuops.ops.commands import Caller, Commands
from gpuops.record.audit import Auditor, read_audit
from gpuops.settings import ChatopsSettings, NatsSettings
from gpuops.sim.fleet import SimFleet
from prometheus_client import CollectorRegistry

from tests.conftest import wait_for
from tests.support import gpuops_argv

pytestmark = pytest.mark.faults
ROOT = Path(__file__).resolve().parents[2]
SECRET = "8f742231b10e8888abcd99yyyzzz85a5"
TOKEN = "mm-token-123-4567-89ab-cdef"  # Mattermost makes 26-character ones
TEAM, ALICE_ID = "T0TEAM", "U0ALICE"
ALICE = f"slack:{TEAM}/{ALICE_ID}"
MM_TEAM, MM_ALICE_ID = "kwoknj9nwpypzgzy78wkw516qe", "rnina9994bde8mua79zqcg5hmo"
MM_ALICE = f"mattermost:{MM_TEAM}/{MM_ALICE_ID}"
GRANTS = {"drain": {"users": [ALICE]}, "silence": {"users": [ALICE, MM_ALICE]}}


class Endpoint:
    """One ChatOps endpoint on loopback, with its clock and metrics registry."""

    def __init__(self, bus: Bus, fleet: SimFleet, **settings: Any) -> None:
        self.clock = ManualClock()
        self.registry = CollectorRegistry()
        self.settings = ChatopsSettings.model_validate(
            {
                "slack_signing_secret": SECRET,
                "mattermost_tokens": [TOKEN],
                "permissions": GRANTS,
                **settings,
            }
        )
        inventory = load_inventory(fleet.root / "inventory")
        commands = Commands.over_bus(bus, self.clock, inventory, self.settings)
        auditor = Auditor(JetStreamPublisher(bus.js))
        self.chatops = Chatops(
            commands, self.settings, auditor, self.clock, self.registry, bus.buckets.replay
        )
        self.server = HttpServer(self.registry, lambda: (True, {}), [self.chatops.mount])
        self.url = ""

    async def __aenter__(self) -> Endpoint:
        self.url = f"http://127.0.0.1:{await self.server.start('127.0.0.1:0')}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.server.stop()

    def rejected(self, reason: str) -> float:
        """The rejection counter for one reason, as /metrics shows it."""
        value = self.registry.get_sample_value(
            "gpuops_chatops_rejections_total", {"reason": reason}
        )
        return value or 0.0

    async def post(self, path: str, **kwargs: Any) -> tuple[int, Any]:
        async with (
            aiohttp.ClientSession() as session,
            session.post(self.url + path, **kwargs) as reply,
        ):
            return reply.status, await reply.json()


def signed(body: bytes, stamp: str) -> dict[str, str]:
    """Headers of a Slack request signed with the secret."""
    return {
        "Content-Type": "application/x-www-form-urlencoded",
        "X-Slack-Request-Timestamp": stamp,
        "X-Slack-Signature": slack_signature(SECRET, stamp, body),
    }


def slack_body(text: str, **extra: str) -> bytes:
    """A slash command from alice (team T0TEAM, user U0ALICE) unless `extra` says otherwise."""
    fields = {"text": text, "team_id": TEAM, "user_id": ALICE_ID, "user_name": "alice"}
    return urlencode({**fields, "channel_name": "ops", **extra}).encode()


def mattermost_body(text: str, **extra: str) -> dict[str, str]:
    """A Mattermost slash command from alice, with its token."""
    return {
        "token": TOKEN,
        "text": text,
        "team_id": MM_TEAM,
        "user_id": MM_ALICE_ID,
        "user_name": "alice",
        "channel_name": "ops",
        **extra,
    }


@pytest.fixture
async def endpoint(bus: Bus, fleet: SimFleet) -> AsyncIterator[Endpoint]:
    async with Endpoint(bus, fleet) as e:
        yield e


async def chatops_events(bus: Bus, node: str) -> int:
    """How many chatops events about `node` the events stream holds."""
    info = await bus.js.stream_info(EVENTS, subjects_filter=f"gpuops.events.*.chatops.{node}")
    return sum((info.state.subjects or {}).values())


async def rejection_notes(bus: Bus) -> list[dict[str, int]]:
    """The counts of every rejection summary in the audit trail."""
    records = [r async for r in read_audit(bus.js)]
    return [r.body["rejected"] for r in records if r.summary.startswith("chatops requests rej")]


async def test_a_replayed_signed_slack_request_is_refused_and_counted(
    endpoint: Endpoint, bus: Bus
) -> None:
    body = slack_body("drain node-002 'bad fan'")
    headers = signed(body, str(int(endpoint.clock.now())))
    first = await endpoint.post("/chatops/slack", data=body, headers=headers)
    assert first[0] == 200 and first[1]["text"].startswith("drain of node-002 requested")
    endpoint.clock.advance(120)  # still inside the five-minute window
    again = await endpoint.post("/chatops/slack", data=body, headers=headers)
    assert again == (401, {"error": "replayed"})
    assert endpoint.rejected("replayed") == 1
    assert await chatops_events(bus, "node-002") == 1, "the replay requested nothing"


async def test_a_slack_replay_to_another_engine_on_the_same_bus_is_refused(
    bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    # Two engines' endpoints, each with its own connection to one NATS: a second replica,
    # or the same engine restarted. The request runs on the first only.
    body = slack_body("silence node:node-002 30m 'fan swap'")
    other = await connect(nats_server.url, NatsSettings())
    try:
        async with Endpoint(bus, fleet) as one, Endpoint(other, fleet) as two:
            headers = signed(body, str(int(one.clock.now())))
            first = await one.post("/chatops/slack", data=body, headers=headers)
            assert first[0] == 200 and first[1]["text"].startswith("silence ")
            again = await two.post("/chatops/slack", data=body, headers=headers)
            assert again == (401, {"error": "replayed"})
            assert two.rejected("replayed") == 1
    finally:
        await other.close()
    assert await ran_once(bus, "silence node:node-002")


async def silences(bus: Bus) -> list[tuple[str, str]]:
    """Every silence on the bus: target and who set it."""
    return [(s.target, s.by) for s in await SilenceStore(NatsKV(bus.kv["control"])).all()]


async def command_notes(bus: Bus, command: str) -> list[str]:
    """The audit's notes of `command` having run (the line each carries)."""
    records = [r async for r in read_audit(bus.js)]
    return [r.summary for r in records if r.type == "note" and f": {command}" in r.summary]


async def ran_once(bus: Bus, command: str) -> bool:
    """Whether `command` (a silence) ran exactly once: one silence, one note, one event."""
    target = command.split()[1]
    made = [s for s in await silences(bus) if s[0] == target]
    notes = await command_notes(bus, command)
    assert (len(made), len(notes)) == (1, 1), (made, notes)
    return await chatops_events(bus, "fleet") == 1  # a silence's event is the fleet's


async def test_a_renamed_slack_user_is_the_same_principal_with_the_same_grants(
    endpoint: Endpoint, bus: Bus
) -> None:
    body = slack_body("silence node:node-001 30m 'fan swap'", user_name="alice-new")
    headers = signed(body, str(int(endpoint.clock.now())))
    status, answer = await endpoint.post("/chatops/slack", data=body, headers=headers)
    assert status == 200 and answer["text"].startswith("silence "), answer
    assert await silences(bus) == [("node:node-001", ALICE)], "recorded as the principal"
    [note] = await command_notes(bus, "silence node:node-001")
    assert note.startswith(f"{ALICE} (alice-new): silence"), "the name beside, for reading"


# An impostor calls themselves what the granted person is called, or what the grant says.
IMPOSTOR_NAMES = ["alice", ALICE]


@pytest.mark.parametrize("name", IMPOSTOR_NAMES)
async def test_another_slack_user_with_the_granted_users_name_is_refused(
    endpoint: Endpoint, bus: Bus, name: str
) -> None:
    body = slack_body("silence node:node-001 30m x", user_id="U0MALLORY", user_name=name)
    headers = signed(body, str(int(endpoint.clock.now())))
    status, answer = await endpoint.post("/chatops/slack", data=body, headers=headers)
    impostor = f"slack:{TEAM}/U0MALLORY ({name})"
    assert (status, answer["text"]) == (200, f"refused: {impostor} may not run 'silence'")
    assert await silences(bus) == []
    records = [r async for r in read_audit(bus.js)]
    assert any(r.summary.startswith(f"refused silence from {impostor}") for r in records)


@pytest.mark.parametrize("name", IMPOSTOR_NAMES)
async def test_a_user_of_another_team_with_the_same_user_id_is_refused(
    endpoint: Endpoint, bus: Bus, name: str
) -> None:
    body = slack_body("silence node:node-001 30m x", team_id="T0OTHER", user_name=name)
    headers = signed(body, str(int(endpoint.clock.now())))
    status, answer = await endpoint.post("/chatops/slack", data=body, headers=headers)
    outsider = f"slack:T0OTHER/{ALICE_ID} ({name})"
    assert (status, answer["text"]) == (200, f"refused: {outsider} may not run 'silence'")
    assert await silences(bus) == []


async def test_a_slack_request_for_another_app_or_without_ids_is_refused(
    bus: Bus, fleet: SimFleet
) -> None:
    async with Endpoint(bus, fleet, slack_app_id="A0GPUOPS") as endpoint:
        for extra, refusal in (
            ({"api_app_id": "A0OTHER"}, (401, {"error": "wrong_app"})),
            ({}, (401, {"error": "wrong_app"})),  # an app that names none is not ours either
            ({"api_app_id": "A0GPUOPS", "user_id": ""}, (400, {"error": "no_principal"})),
            ({"api_app_id": "A0GPUOPS", "user_id": "U0/../T1"}, (400, {"error": "no_principal"})),
        ):
            body = slack_body("silence node:node-001 30m x", **extra)
            headers = signed(body, str(int(endpoint.clock.now())))
            assert await endpoint.post("/chatops/slack", data=body, headers=headers) == refusal
        body = slack_body("silence node:node-001 30m x", api_app_id="A0GPUOPS")
        headers = signed(body, str(int(endpoint.clock.now())))
        assert (await endpoint.post("/chatops/slack", data=body, headers=headers))[0] == 200
    assert await ran_once(bus, "silence node:node-001")


# A slash command carries a trigger_id, an outgoing webhook a post_id; others only a body.
MATTERMOST_IDS = [
    {"trigger_id": "6fm7cbyx5jnyzbu4pq8rwd4mnr:kwok:1767225600000:ab"},
    {"post_id": "axdygg1957njfe5pu38saikdho", "timestamp": "1767225600"},
    {},
]


@pytest.mark.parametrize("ids", MATTERMOST_IDS, ids=["trigger_id", "post_id", "body"])
async def test_a_mattermost_request_posted_twice_runs_once(
    endpoint: Endpoint, bus: Bus, ids: dict[str, str]
) -> None:
    form = mattermost_body("silence node:node-002 30m 'fan swap'", **ids)
    first = await endpoint.post("/chatops/mattermost", data=form)
    assert first[0] == 200 and first[1]["text"].startswith("silence "), first
    endpoint.clock.advance(60)
    assert await endpoint.post("/chatops/mattermost", data=form) == (401, {"error": "replayed"})
    assert endpoint.rejected("replayed") == 1
    assert await ran_once(bus, "silence node:node-002")
    assert await silences(bus) == [("node:node-002", MM_ALICE)]


async def test_a_mattermost_replay_to_another_engine_on_the_same_bus_is_refused(
    bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    form = mattermost_body("silence node:node-002 30m 'fan swap'", trigger_id="t1:k:1:x")
    other = await connect(nats_server.url, NatsSettings())
    try:
        async with Endpoint(bus, fleet) as one, Endpoint(other, fleet) as two:
            assert (await one.post("/chatops/mattermost", data=form))[0] == 200
            again = await two.post("/chatops/mattermost", data=form)
            assert again == (401, {"error": "replayed"})
    finally:
        await other.close()
    assert await ran_once(bus, "silence node:node-002")


async def test_a_mattermost_request_without_team_or_user_id_is_refused(
    endpoint: Endpoint, bus: Bus
) -> None:
    for missing in ("team_id", "user_id"):
        form = mattermost_body("silence node:node-002 30m x", **{missing: ""})
        answer = await endpoint.post("/chatops/mattermost", data=form)
        assert answer == (400, {"error": "no_principal"})
    assert await silences(bus) == []


async def test_a_request_is_refused_while_the_replay_bucket_cannot_be_asked(
    endpoint: Endpoint, bus: Bus, nats_server: EmbeddedNats
) -> None:
    # Serving without asking could serve a replay another engine already served.
    nats_server.stop()
    body = slack_body("status")
    headers = signed(body, str(int(endpoint.clock.now())))
    answer = await endpoint.post("/chatops/slack", data=body, headers=headers)
    assert answer == (503, {"error": "replay_unchecked"})
    assert endpoint.rejected("replay_unchecked") == 1
    nats_server.start()
    await wait_for(lambda: bus.nc.is_connected, 30)


@pytest.mark.parametrize(
    "stamp", ["nan", "NaN", "inf", "-1767225600", "+1767225600", "1767225600.0", "1.7672256e9"]
)
async def test_slack_timestamps_that_are_not_whole_ascii_seconds_are_refused(
    endpoint: Endpoint, stamp: str
) -> None:
    body = slack_body("status")
    status, answer = await endpoint.post("/chatops/slack", data=body, headers=signed(body, stamp))
    assert (status, answer) == (401, {"error": "bad_timestamp"})
    assert endpoint.rejected("bad_timestamp") == 1


async def test_response_url_is_posted_only_to_allowed_hosts(bus: Bus, fleet: SimFleet) -> None:
    posted: list[Any] = []

    async def record(request: web.Request) -> web.Response:
        posted.append(await request.json())
        return web.Response()

    app = web.Application()
    app.router.add_post("/hook", record)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    inward = [
        f"http://127.0.0.1:{port}/hook",
        f"http://hooks.slack.com@127.0.0.1:{port}/hook",
        f"http://localhost:{port}/hook",
    ]
    try:
        async with Endpoint(bus, fleet) as default:
            for url in inward:
                body = slack_body("status", response_url=url)
                stamp = str(int(default.clock.now()))
                reply = await default.post("/chatops/slack", data=body, headers=signed(body, stamp))
                assert reply[0] == 200, "the request is served; only its response_url is not"
        assert posted == []
        assert default.registry.get_sample_value("gpuops_chatops_response_url_refused_total") == 3
        async with Endpoint(bus, fleet, slack_response_hosts=["127.0.0.1"]) as allowing:
            allowing.clock.advance(1)  # not the first request again: that one was served
            body = slack_body("status", response_url=inward[0])
            headers = signed(body, str(int(allowing.clock.now())))
            assert (await allowing.post("/chatops/slack", data=body, headers=headers))[0] == 200
        assert len(posted) == 1 and "breaker: closed" in posted[0]["text"]
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("body", "status", "reason"),
    [
        (b"{not json", 400, "malformed"),
        (b'["token", "text"]', 400, "malformed"),
        (b"[" * 50_000, 400, "malformed"),
        (b"\x80{}", 400, "malformed"),
        ('{"token": "t\u00f6ken", "text": "status"}'.encode(), 401, "bad_token"),
        (b'{"text": "status"}', 401, "missing_token"),
    ],
)
async def test_malformed_mattermost_bodies_get_400_and_bad_tokens_401(
    endpoint: Endpoint, bus: Bus, body: bytes, status: int, reason: str
) -> None:
    headers = {"Content-Type": "application/json"}
    answer = await endpoint.post("/chatops/mattermost", data=body, headers=headers)
    assert answer == (status, {"error": reason})
    assert endpoint.rejected(reason) == 1
    assert await rejection_notes(bus) == [{reason: 1}], "audited, not a 500"


async def test_a_flood_of_unsigned_requests_is_counted_and_audited_once_per_interval(
    endpoint: Endpoint, bus: Bus
) -> None:
    for _ in range(50):
        assert (await endpoint.post("/chatops/slack", data=b"text=status"))[0] == 401
    assert endpoint.rejected("unsigned") == 50
    assert await rejection_notes(bus) == [{"unsigned": 1}], "the first at once, then one a minute"
    endpoint.clock.advance(endpoint.settings.rejection_note_interval_s)
    assert (await endpoint.post("/chatops/slack", data=b"text=status"))[0] == 401
    assert await rejection_notes(bus) == [{"unsigned": 1}, {"unsigned": 50}]


async def test_history_prints_rich_markup_sent_from_chat(
    bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    settings = ChatopsSettings()
    commands = Commands.over_bus(
        bus, ManualClock(), load_inventory(fleet.root / "inventory"), settings
    )
    reply = await commands.run('silence node:node-001 1m "[/]x[bold]y"', Caller.of("cli", "alice"))
    assert reply.startswith("silence ")
    cli = await asyncio.create_subprocess_exec(
        *gpuops_argv(state_dir=tmp_path / "cli"),
        *("history", "--nats", nats_server.url),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(cli.communicate(), 60)
    assert cli.returncode == 0, stderr.decode()
    assert "[/]x[bold]y" in stdout.decode(), "shown as typed, not read as markup"


async def test_a_refusal_while_nats_is_away_is_still_a_401_and_counted_later(
    endpoint: Endpoint, bus: Bus, nats_server: EmbeddedNats
) -> None:
    nats_server.stop()
    assert await endpoint.post("/chatops/slack", data=b"text=status") == (
        401,
        {"error": "unsigned"},
    )
    assert endpoint.rejected("unsigned") == 1
    nats_server.start()
    await wait_for(lambda: bus.nc.is_connected, 30)
    endpoint.clock.advance(endpoint.settings.rejection_note_interval_s)
    assert (await endpoint.post("/chatops/slack", data=b"text=status"))[0] == 401
    records = [r async for r in read_audit(bus.js)]
    last = [r.body for r in records if r.summary.startswith("chatops requests rej")][-1]
    assert last["total"] == {"unsigned": 2}, "the summary after the outage counts both"
