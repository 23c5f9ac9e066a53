"""The console's HTTP surface on a running engine: read-only by default, actions only for
a logged-in user the ChatOps table grants, from the console's own pages, inputs bounded."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import aiohttp
import pytest
from gpuops.bus.conn import Bus
from gpuops.bus.server import EmbeddedNats
from gpuops.decide.breaker import BreakerState
from gpuops.decide.correlate import DomainFaults, correlation_store
from gpuops.models import new_event, subject_for
from gpuops.ops.commands import render_status
from gpuops.record.audit import read_audit
from gpuops.sim.fleet import SimFleet

from tests.conftest import engine_settings, running_engine, wait_for

pytestmark = pytest.mark.integration
ALICE, BOB = "alice-token-0123456789abcdef", "bob-token-0123456789abcdef"
PROXY_SECRET = "proxy-secret-0123456789abcdef"


def _settings(tmp_path: Path, fleet: SimFleet, url: str, **console: object) -> object:
    return engine_settings(
        tmp_path,
        fleet,
        url,
        http="127.0.0.1:0",
        console={
            "tokens": [{"user": "alice", "token": ALICE}, {"user": "bob", "token": BOB}],
            "user_header": "X-Forwarded-User",
            "proxy_secret": PROXY_SECRET,
            **console,
        },
        chatops={
            "permissions": {
                c: {"users": ["console:alice"]} for c in ("breaker", "silence", "unsilence")
            }
        },
    )


def _token(html: str) -> str:
    found = re.search(r'name="form_token" value="([0-9a-f]+)"', html)
    assert found, "the page carries a form token"
    return found.group(1)


async def test_reading_is_open_acting_needs_a_granted_login_from_the_console(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    settings = _settings(tmp_path, fleet, nats_server.url)
    async with running_engine(settings, bus) as app:  # type: ignore[arg-type]
        await app.engine.breaker.set_state(BreakerState.OPEN, "test storm", app.clock.now(), "t")
        await wait_for(lambda: app.http_port, 30)
        base = f"http://127.0.0.1:{app.http_port}"
        # The gauges people graph: nodes by state, the breaker's state (refreshed by the tick).
        metrics = app.engine.metrics
        await wait_for(lambda: metrics.breaker_state.labels("open")._value.get() == 1.0, 30)
        assert metrics.breaker_state.labels("closed")._value.get() == 0.0
        assert metrics.node_states.labels("healthy")._value.get() == 2.0
        async with aiohttp.ClientSession(base, cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
            for page in ("/console/fleet", "/console/now", "/console/node/node-001"):
                async with http.get(page) as r:
                    assert r.status == 200, page
                    assert "default-src 'self'" in r.headers["Content-Security-Policy"]
            async with http.get("/console/api/fleet") as r:
                fleet_json = await r.json()
            assert fleet_json["nodes"] == ["node-001", "node-002"]
            # Nobody logged in: no action.
            async with http.post("/console/breaker", data={"to": "reset"}) as r:
                assert r.status == 401
            # A bearer token needs no form token, but bob is not granted the breaker.
            headers = {"Authorization": f"Bearer {BOB}"}
            async with http.post(
                "/console/breaker", data={"to": "reset"}, headers=headers, allow_redirects=False
            ) as r:
                assert r.status == 303 and "ok=0" in r.headers["Location"]
                assert "may%20not%20run" in r.headers["Location"]
            # alice behind the trusted proxy: a form from another site is refused ...
            proxied = {"X-Forwarded-User": "alice", "X-Gpuops-Proxy-Secret": PROXY_SECRET}
            async with http.get("/console/now", headers=proxied) as r:
                token = _token(await r.text())
            forged = {**proxied, "Origin": "https://evil.example"}
            form = {"to": "reset", "form_token": token}
            async with http.post("/console/breaker", data=form, headers=forged) as r:
                assert r.status == 403
            # ... and her own page's form resets the breaker through the command table.
            own = {**proxied, "Origin": base}
            async with http.post(
                "/console/breaker", data=form, headers=own, allow_redirects=False
            ) as r:
                assert r.status == 303 and "ok=1" in r.headers["Location"]
            # Silences: created and expired from the page, as alice (a bearer token here).
            alice = {"Authorization": f"Bearer {ALICE}"}
            silence = {"target": "node:node-002", "duration": "2h", "reason": "fan swap"}
            async with http.post("/console/silences", data=silence, headers=alice) as r:
                assert r.status == 200 and "fan swap" in await r.text()
            [made] = await app.engine.silences.all()
            assert (made.target, made.by) == ("node:node-002", "console:alice")
            async with http.post(f"/console/silences/{made.id}/expire", headers=alice) as r:
                assert r.status == 200 and f"silence {made.id} removed" in await r.text()
            assert await app.engine.silences.all() == []
        state, _ = await app.engine.breaker.get()
        assert state.state is BreakerState.CLOSED and "alice" in state.why
        await wait_for(lambda: metrics.breaker_state.labels("closed")._value.get() == 1.0, 30)
        async with aiohttp.ClientSession() as http, http.get(f"{base}/metrics") as r:
            text = await r.text()
        assert 'gpuops_nodes{state="healthy"} 2.0' in text
        assert 'gpuops_breaker_state{state="open"} 0.0' in text
    notes = [r.summary async for r in read_audit(bus.js) if r.type == "note"]
    assert any(n.startswith("console:alice: breaker reset") for n in notes), notes
    assert any("refused breaker from console:bob" in n for n in notes), notes


async def test_session_login_and_bounded_inputs(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    settings = _settings(tmp_path, fleet, nats_server.url, login_required=True)
    async with running_engine(settings, bus) as app:  # type: ignore[arg-type]
        await wait_for(lambda: app.http_port, 30)
        base = f"http://127.0.0.1:{app.http_port}"
        async with aiohttp.ClientSession(base, cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
            async with http.get("/console/now", allow_redirects=False) as r:
                assert r.status == 302 and r.headers["Location"].startswith("/console/login")
            origin = {"Origin": base}
            async with http.post("/console/login", data={"token": "wrong"}, headers=origin) as r:
                assert r.status == 401 and "unknown token" in await r.text()
            async with http.post(
                "/console/login",
                data={"token": ALICE, "next": "https://evil.example/"},
                headers=origin,
                allow_redirects=False,
            ) as r:
                assert r.status == 303 and r.headers["Location"] == "/console/now"
            async with http.get("/console/now") as r:
                assert r.status == 200 and "alice" in await r.text()
            bad = {
                "/console/api/fleet?group=nope": 400,
                "/console/events?since=-1": 400,
                "/console/node/node-999": 404,
                "/console/node/node-001?days=x": 400,
                "/console/runs/..%2F..%2Fetc": 404,
            }
            for path, status in bad.items():
                async with http.get(path) as r:
                    assert r.status == status, path
            # A path out of runs/ to a file that is there is refused by name, not by luck.
            outside = settings.state_dir / "etc"  # type: ignore[attr-defined]
            outside.mkdir(parents=True)
            (outside / "stdout").write_text("secret")
            async with http.get("/console/runs/..%2Fetc") as r:
                assert r.status == 404 and "secret" not in (text := await r.text())
                assert "not a run id" in text, text
            form = {"answer": "approve", "reason": "x" * 501, "form_token": "t"}
            async with http.post("/console/approvals/abc", data=form, headers=origin) as r:
                assert r.status == 400 and "at most 500" in await r.text()
            async with http.post(
                "/console/approvals/NOT-AN-ID", data={**form, "reason": "ok"}, headers=origin
            ) as r:
                assert r.status == 400
            async with http.post("/console/logout", allow_redirects=False) as r:
                assert r.status == 303
            async with http.get("/console/now", allow_redirects=False) as r:
                assert r.status == 302


async def test_the_now_page_shows_each_budget_that_holds_and_what_its_gpus_draw(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    settings = engine_settings(
        tmp_path,
        fleet,
        nats_server.url,
        http="127.0.0.1:0",
        dry_run=True,  # the controller decides; nothing runs
        power={"budgets": [{"group": "rack-a1", "watts": "5kW"}]},
    )
    async with running_engine(settings, bus) as app:
        await wait_for(lambda: app.http_port, 30)
        gpus = [{"index": i, "power_w": 450.0, "power_limit_w": 700.0} for i in range(4)]
        event = new_event("telemetry", "node-001", time.time(), {"gpus": gpus}, "test")
        payload = json.dumps(event).encode()
        headers = app.keys.node("node-001").headers(payload)  # as node-001's agent signs it
        await bus.js.publish(subject_for("telemetry", "node-001"), payload, headers=headers)
        await wait_for(lambda: app.latest.gpus("node-001"), 30)
        base = f"http://127.0.0.1:{app.http_port}"
        async with aiohttp.ClientSession(base) as http, http.get("/console/now") as page:
            html = await page.text()

    panel = html[html.index('<section id="power-budgets">') :]
    row = re.search(r"<tr[^>]*><td>rack-a1</td><td>(\d+)</td><td>(\d+)</td><td>([^<]+)</td>", panel)
    assert row is not None, panel[:600]
    assert row.groups() == ("5000", "1800", "base"), "the budget, the GPUs' draw, its source"


async def test_a_domain_episode_is_one_row_on_now_and_the_fleet_groups_by_rack(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    settings = engine_settings(tmp_path, fleet, nats_server.url, http="127.0.0.1:0")
    async with running_engine(settings, bus) as app:
        await wait_for(lambda: app.http_port, 30)
        now = app.clock.now()
        held = ("node-001", "node-002")
        episode = DomainFaults(
            seen={n: (now - 20, now) for n in held},
            opened=now - 5,
            until=now + 900,
            nodes=held,
            applied=True,
        )
        store = correlation_store(app.engine.buckets.control)
        await store.put(episode, "gpu-overheat", "rack", "rack-a1")
        said = render_status(await app.commands().status())
        assert "domain episode: gpu-overheat on rack rack-a1 (2 nodes: node-001, node-002)" in said
        base = f"http://127.0.0.1:{app.http_port}"
        async with aiohttp.ClientSession(base) as http:
            async with http.get("/console/now") as page:
                now_html = await page.text()
            async with http.get("/console/fleet", params={"domain": "rack"}) as page:
                fleet_html = await page.text()
            async with http.get("/console/fleet", params={"group": "rack-a1"}) as page:
                assert page.status == 200, "a domain is a group of the fleet page"

    section = now_html[now_html.index('<section id="domain-episodes"') :]
    section = section[: section.index("</section>")]
    assert 'data-count="1"' in section and section.count('class="domain-episode"') == 1
    assert "rack rack-a1" in section and "gpu-overheat on 2 nodes" in section
    assert all(f'/console/node/{n}"' in section for n in held)
    domains = fleet_html[fleet_html.index('<section id="domains"') :]
    rows = re.findall(r'<tr class="domain"( data-episode="1")?><td><a [^>]*>([^<]+)</a>', domains)
    assert rows == [(' data-episode="1"', "rack-a1")], "one row per rack, its episode marked"
    assert "<td>2</td>" in domains, "the rack's two nodes"
