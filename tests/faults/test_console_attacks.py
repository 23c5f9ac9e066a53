"""The console as an attacker tries it (issue 25), over real HTTP and a real nats-server:
a user header sent by any local process, anonymous reads of a console bound to every
address, session cookies that travel in clear, failed runs' text shown to nobody in
particular, a malformed audit record in a node's view, one-character tokens, and
token guessing at full speed."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gpuops import subjects
from gpuops.act.evidence import Evidence
from gpuops.bus.conn import Bus, connect
from gpuops.bus.server import EmbeddedNats
from gpuops.clock import ManualClock
from gpuops.console import Console, Latest
from gpuops.console.auth import COOKIE
from gpuops.errors import ConfigError
from gpuops.http import HttpServer
from gpuops.inventory.hosts import load_inventory
from gpuops.models import AuditRecord
from gpuops.ops.commands import Commands
from gpuops.settings import ChatopsSettings, ConsoleSettings, load_settings
from gpuops.sim.fleet import SimFleet
from prometheus_client import CollectorRegistry

from tests.conftest import engine_settings, running_engine, wait_for
from tests.deploy.test_nats import PASSWORDS, as_role, generate

pytestmark = pytest.mark.faults
ALICE = "alice-console-token-0123456789abcdef"
PROXY_SECRET = "proxy-shared-secret-0123456789abcdef"
SECRET_HEADER = "X-Gpuops-Proxy-Secret"
PROXY = {"user_header": "X-Forwarded-User", "proxy_secret": PROXY_SECRET}
RUN_ID = "20260101T120000-1a2b3c4d"


class Site:
    """One console on a real HTTP server over a real bus, with its clock and metrics."""

    def __init__(
        self, bus: Bus, fleet: SimFleet, tmp_path: Path, bind: str = "127.0.0.1:0", **console: Any
    ) -> None:
        self.clock = ManualClock(time.time())
        self.registry = CollectorRegistry()
        settings = ConsoleSettings.model_validate(
            {"tokens": [{"user": "alice", "token": ALICE}], **console}
        )
        inventory = load_inventory(fleet.root / "inventory")
        commands = Commands.over_bus(bus, self.clock, inventory, ChatopsSettings())
        self.console = Console(
            commands,
            settings,
            Latest(inventory),
            Evidence(tmp_path / "runs"),
            bind=bind,
            clock=self.clock,
            registry=self.registry,
        )
        self.server = HttpServer(self.registry, lambda: (True, {}), [self.console.mount])
        self.bind = bind
        self.url = ""

    async def __aenter__(self) -> Site:
        self.url = f"http://127.0.0.1:{await self.server.start(self.bind)}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.server.stop()

    def counted(self, name: str, **labels: str) -> float:
        """A counter of the console's, as /metrics shows it."""
        return self.registry.get_sample_value(name, labels) or 0.0

    async def get(self, path: str, **headers: str) -> tuple[int, str, Any]:
        """Status, body and headers of a GET (redirects not followed)."""
        async with (
            aiohttp.ClientSession() as http,
            http.get(self.url + path, headers=headers, allow_redirects=False) as r,
        ):
            return r.status, await r.text(), r.headers

    async def post(self, path: str, form: dict[str, str], **headers: str) -> int:
        """The status of a form POSTed from the console's own page (redirects not followed)."""
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                self.url + path,
                data=form,
                headers={"Origin": self.url, **headers},
                allow_redirects=False,
            ) as r,
        ):
            return r.status

    async def login(self, token: str, **headers: str) -> aiohttp.ClientResponse:
        """POST the login form from the console's own page; the response, body read."""
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                self.url + "/console/login",
                data={"token": token},
                headers={"Origin": self.url, **headers},
                allow_redirects=False,
            ) as r,
        ):
            await r.read()
            return r


def bearer(token: str = ALICE) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# --- 1. the proxy's user header needs the proxy's secret ------------------------------


async def test_a_user_header_without_the_proxy_secret_names_nobody_and_is_logged(
    bus: Bus, fleet: SimFleet, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gpuops.console")
    # The setting the docs used to give: the proxy's address, 127.0.0.1, which every
    # process on the host has. Now the secret decides; the address only narrows.
    settings = {**PROXY, "trusted_proxies": ["127.0.0.1"], "anonymous_read": "never"}
    async with Site(bus, fleet, tmp_path, **settings) as site:
        claim = {"X-Forwarded-User": "alice"}
        status, _, headers = await site.get("/console/now", **claim)
        assert status == 302 and headers["Location"].startswith("/console/login"), status
        wrong = {**claim, SECRET_HEADER: PROXY_SECRET[:-1] + "x"}
        status, _, _ = await site.get("/console/now", **wrong)
        assert status == 302, "a wrong secret is no better than none"
        status, body, _ = await site.get("/console/now", **claim, **{SECRET_HEADER: PROXY_SECRET})
        assert status == 200 and "alice" in body, "the proxy itself is believed"
        assert site.counted("gpuops_console_login_failures_total", via="proxy") == 2
    refused = [
        r for r in caplog.records if "console login failed from 127.0.0.1 (proxy)" in r.message
    ]
    assert len(refused) == 2, caplog.text
    assert PROXY_SECRET not in caplog.text


def test_a_user_header_without_a_proxy_secret_is_a_settings_error() -> None:
    environ = {"GPUOPS_CONSOLE__USER_HEADER": "X-Forwarded-User"}
    with pytest.raises(ConfigError, match=r"console: .*user_header is set but proxy_secret"):
        load_settings(None, {}, environ)


# --- 2. no anonymous reads off loopback ------------------------------------------------


async def test_a_console_bound_to_every_address_refuses_anonymous_reads(
    bus: Bus, fleet: SimFleet, tmp_path: Path
) -> None:
    async with Site(bus, fleet, tmp_path, bind="0.0.0.0:0") as site:
        for page in ("/console/fleet", "/console/now", "/console/node/node-001"):
            status, _, headers = await site.get(page)
            assert status == 302 and headers["Location"].startswith("/console/login?next="), page
        for api in ("/console/api/fleet", "/console/api/node/node-001/telemetry"):
            assert (await site.get(api))[0] == 401, api
        assert (await site.get("/console/login"))[0] == 200, "the way in stays open"
        assert (await site.get("/console/fleet", **bearer()))[0] == 200
    async with Site(bus, fleet, tmp_path, bind="0.0.0.0:0", anonymous_read="always") as site:
        assert (await site.get("/console/fleet"))[0] == 200, "a site may opt in"


async def test_the_engine_tells_its_console_where_it_listens(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    settings = engine_settings(tmp_path, fleet, nats_server.url, http="0.0.0.0:0")
    async with running_engine(settings, bus) as app:
        await wait_for(lambda: app.http_port, 30)
        url = f"http://127.0.0.1:{app.http_port}/console/fleet"
        async with aiohttp.ClientSession() as http, http.get(url, allow_redirects=False) as r:
            assert r.status == 302 and r.headers["Location"].startswith("/console/login")


# --- 3. the session cookie: Secure behind TLS, HttpOnly, SameSite ----------------------


async def test_the_session_cookie_is_secure_when_the_proxy_says_https(
    bus: Bus, fleet: SimFleet, tmp_path: Path
) -> None:
    async with Site(bus, fleet, tmp_path, **PROXY) as site:
        https = {"X-Forwarded-Proto": "https"}
        vouched = await site.login(ALICE, **https, **{SECRET_HEADER: PROXY_SECRET})
        assert vouched.status == 303
        cookie = vouched.cookies["gpuops_console"]
        assert cookie["secure"] and cookie["httponly"] and cookie["samesite"] == "Strict"
        # Anyone can write X-Forwarded-Proto: without the secret it is not believed.
        claimed = await site.login(ALICE, **https)
        assert claimed.status == 303 and not claimed.cookies["gpuops_console"]["secure"]
    async with Site(bus, fleet, tmp_path, cookie_secure="always") as site:
        forced = await site.login(ALICE)
        assert forced.status == 303 and forced.cookies["gpuops_console"]["secure"]


# --- 4. and 5. a node's timeline: private text, malformed records -----------------------


def run_record(node: str, **body: Any) -> AuditRecord:
    """A run record as the recorder writes it (summary with the error, body the outcome)."""
    outcome = {
        "intent_key": "k1",
        "rule": "gpu-overheat",
        "node": node,
        "playbook": "drain.yml",
        "status": "failed",
        "rc": 2,
        "started": time.time() - 5,
        "ended": time.time(),
        "run_id": RUN_ID,
        "revision": "838293f8f3cd0000",
        "error": "become password for ops-admin refused",
        "failed_task": "Drain the node with the site token",
        "failed_message": "scontrol: auth token 5f2b0c not accepted",
        **body,
    }
    summary = f"drain.yml failed rc=2 in 5.0s: {outcome['error']}"
    return AuditRecord(
        type="run", at=time.time(), node=node, rule="gpu-overheat", summary=summary, body=outcome
    )


async def publish(bus: Bus, node: str, payload: bytes | AuditRecord) -> None:
    data = payload.model_dump_json().encode() if isinstance(payload, AuditRecord) else payload
    await bus.js.publish(subjects.audit(node), data)


async def test_anonymous_viewers_see_that_a_run_failed_not_its_text(
    bus: Bus, fleet: SimFleet, tmp_path: Path
) -> None:
    await publish(bus, "node-001", run_record("node-001"))
    private = ("Drain the node", "auth token 5f2b0c", "ops-admin")
    async with Site(bus, fleet, tmp_path) as site:
        status, page, _ = await site.get("/console/node/node-001")
        assert status == 200
        assert "drain.yml failed" in page and "log in to see the details of this run" in page
        assert not [text for text in private if text in page], "no failed-task text"
        status, page, _ = await site.get("/console/node/node-001", **bearer())
        assert status == 200 and all(text in page for text in private), "alice sees why"


@pytest.fixture
def site_nats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[EmbeddedNats]:
    """A nats-server with a site's per-role users (deploy/nats), passwords in its env."""
    for role, password in PASSWORDS.items():
        monkeypatch.setenv(generate.password_var(role), password)
    server = EmbeddedNats(tmp_path / "site-nats", config_text=generate.auth_conf()).start()
    yield server
    server.stop()


@pytest.fixture
async def engine_bus(site_nats: EmbeddedNats) -> AsyncIterator[Bus]:
    """The engine's own connection: its user, which may write the audit subjects."""
    b = await connect(site_nats.url, as_role("engine"))
    yield b
    await b.close()


MALFORMED: dict[str, bytes | AuditRecord] = {
    "run without failed_task": AuditRecord(
        type="run", at=time.time(), node="node-001", summary="old run", body={"status": "ok"}
    ),
    "run with wrong types": run_record(
        "node-001", failed_task=5, run_id=["../../etc"], revision=7, status=None
    ),
    "decision of the wrong shape": AuditRecord(
        type="decision",
        at=time.time(),
        node="node-001",
        rule="r",
        body={"decision": "x", "facts": [1]},
    ),
    "a time no calendar has": AuditRecord(type="note", at=1e300, node="node-001", summary="far"),
    "not an audit record": b'{"type": "run", "body": 3}',
    "not JSON": b"\xff\xfe garbage",
}


async def test_a_malformed_audit_record_does_not_take_the_node_page_down(
    engine_bus: Bus, fleet: SimFleet, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gpuops.console")
    node = "node-001"
    before = AuditRecord(type="note", at=time.time(), node=node, summary="episode opened")
    after = AuditRecord(type="note", at=time.time(), node=node, summary="episode resolved")
    for record in (before, *MALFORMED.values(), after):
        await publish(engine_bus, node, record)
    async with Site(engine_bus, fleet, tmp_path) as site:
        for _ in range(2):  # the records stay in view: each is logged the first time only
            status, page, _ = await site.get(f"/console/node/{node}", **bearer())
            assert status == 200, page[:500]
            assert "episode opened" in page and "episode resolved" in page
            assert page.count("(partial record)") == 2
            assert page.count("unreadable audit record") == 2
            assert "../../etc" not in page, "a run id that is not one is no link"
    warned = [r for r in caplog.records if r.name.startswith("gpuops.console")]
    assert len(warned) == 4, [r.message for r in warned]


# --- 6. weak secrets -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "template"),
    [
        ("console.tokens.0.token", "console: {{tokens: [{{user: alice, token: {}}}]}}"),
        ("console.proxy_secret", "console: {{user_header: X-User, proxy_secret: {}}}"),
        ("sources.alertmanager.token", "sources: {{alertmanager: {{token: {}}}}}"),
        ("chatops.slack_signing_secret", "chatops: {{slack_signing_secret: {}}}"),
        ("chatops.mattermost_tokens.0", "chatops: {{mattermost_tokens: [{}]}}"),
    ],
)
def test_a_short_secret_is_refused_naming_its_setting(
    setting: str, template: str, tmp_path: Path
) -> None:
    config = tmp_path / "gpuops.yml"
    config.write_text(template.format("s3cr3t") + "\n")
    with pytest.raises(ConfigError) as raised:
        load_settings(config, {}, {})
    message = str(raised.value)
    assert f"{setting}: Value error, too short" in message and "at least 24 characters" in message
    assert "s3cr3t" not in message, "the refused secret is not echoed"
    # 24 characters (what `openssl rand -hex 12` prints; the docs say -hex 24) will do.
    config.write_text(template.format("0123456789abcdef01234567") + "\n")
    load_settings(config, {}, {})


# --- 7. failed logins: throttled, logged, counted -------------------------------------


async def test_failed_logins_are_throttled_per_client_logged_and_counted(
    bus: Bus, fleet: SimFleet, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gpuops.console")
    async with Site(bus, fleet, tmp_path, **PROXY) as site:
        for guess in range(5):
            assert (await site.login(f"guess-{guess}")).status == 401
        throttled = await site.login(ALICE)
        assert throttled.status == 429, "even the right token waits: guesses are what count"
        assert throttled.headers["Retry-After"] == "60"
        assert (await site.get("/console/fleet", **bearer("another-guess")))[0] == 429
        assert site.counted("gpuops_console_login_failures_total", via="form") == 5
        assert site.counted("gpuops_console_logins_throttled_total") == 2
        # Another client, as the proxy (its secret vouches for X-Forwarded-For) saw it.
        elsewhere = {SECRET_HEADER: PROXY_SECRET, "X-Forwarded-For": "203.0.113.9"}
        assert (await site.login(ALICE, **elsewhere)).status == 303
        site.clock.advance(59)
        assert (await site.login(ALICE)).status == 429
        site.clock.advance(2)  # the first failures left the window
        assert (await site.login(ALICE)).status == 303
    failed = [
        r for r in caplog.records if "console login failed from 127.0.0.1 (form)" in r.message
    ]
    assert len(failed) == 5, caplog.text
    assert ALICE not in caplog.text


async def test_guesses_sent_together_are_throttled_as_if_sent_one_by_one(
    bus: Bus, fleet: SimFleet, tmp_path: Path
) -> None:
    """Forty connections send their headers, then their bodies at once: the check before
    the form was read let every one be judged (40 guesses against a limit of 5)."""
    async with Site(bus, fleet, tmp_path) as site:
        host = site.url.removeprefix("http://")
        body = b"token=guess-0123456789abcdef0123456789"
        head = (
            f"POST /console/login HTTP/1.1\r\nHost: {host}\r\nOrigin: {site.url}\r\n"
            "Content-Type: application/x-www-form-urlencoded\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        address, port = host.split(":")
        conns = [await asyncio.open_connection(address, int(port)) for _ in range(40)]
        for _, writer in conns:
            writer.write(head)
            await writer.drain()
        await asyncio.sleep(0.5)  # each handler now waits for its body
        for _, writer in conns:
            writer.write(body)
            await writer.drain()
        codes = []
        for reader, writer in conns:
            codes.append(int((await reader.readline()).split()[1]))
            writer.close()
        assert sorted(set(codes)) == [401, 429] and codes.count(401) == 5, codes
        assert site.counted("gpuops_console_login_failures_total", via="form") == 5


async def test_a_cookie_kept_from_before_logout_acts_no_more(
    bus: Bus, fleet: SimFleet, tmp_path: Path
) -> None:
    async with Site(bus, fleet, tmp_path) as site:
        cookie = (await site.login(ALICE)).cookies[COOKIE].value
        jar = {"Cookie": f"{COOKIE}={cookie}"}
        token = re.search(
            r'name="form_token" value="([0-9a-f]+)"', (await site.get("/console/now", **jar))[1]
        )
        assert token is not None, "logged in: the page carries its form token"
        assert (await site.post("/console/logout", {}, **jar)) == 303
        # The copy of the cookie, and the form token of its session, act no more.
        assert await site.post("/console/breaker", _reset(token.group(1)), **jar) == 401
        assert site.console.auth.viewer(_with_cookie(cookie)).known is False
        fresh = (await site.login(ALICE)).cookies[COOKIE].value
        assert site.console.auth.viewer(_with_cookie(fresh)).user == "alice", "a new session"
        renewed = {"Cookie": f"{COOKIE}={fresh}"}
        stale = await site.post("/console/breaker", _reset(token.group(1)), **renewed)
        assert stale == 403, "a form token of the ended session is no good in the next"


def _reset(token: str) -> dict[str, str]:
    return {"to": "reset", "form_token": token}


def _with_cookie(cookie: str) -> Any:
    """A request as `Auth.viewer` reads it: headers and cookies."""
    from aiohttp.test_utils import make_mocked_request

    return make_mocked_request("GET", "/console/now", headers={"Cookie": f"{COOKIE}={cookie}"})


async def test_a_loopback_console_reads_for_nobody_under_another_host_name(
    bus: Bus, fleet: SimFleet, tmp_path: Path
) -> None:
    """A page elsewhere whose name was made to resolve to 127.0.0.1 (DNS rebinding) asks
    with its own name as Host: open reads are for this host's names only."""
    async with Site(bus, fleet, tmp_path) as site:
        port = site.url.rsplit(":", 1)[1]
        for host in (f"127.0.0.1:{port}", f"localhost:{port}"):
            assert (await site.get("/console/api/fleet", Host=host))[0] == 200
        assert (await site.get("/console/api/fleet", Host=f"rebind.example:{port}"))[0] == 401
        status, _, headers = await site.get("/console/now", Host=f"rebind.example:{port}")
        assert status == 302 and headers["Location"].startswith("/console/login")
        signed_in = await site.get("/console/api/fleet", Host=f"rebind.example:{port}", **bearer())
        assert signed_in[0] == 200, "a login still reads, under any name"
