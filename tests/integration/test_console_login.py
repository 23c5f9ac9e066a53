"""Run output needs a login: the login page says why, and says how where nobody can log
in; the demo's console makes a login, so its run links lead to the output."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from gpuops.bus.conn import Bus
from gpuops.bus.server import EmbeddedNats
from gpuops.cli.demo import demo_console
from gpuops.sim.fleet import SimFleet

from tests.conftest import engine_settings, running_engine, wait_for

pytestmark = pytest.mark.integration
RUN = "20260101T120000-1a2b3c4d"


def _kept_run(state_dir: Path) -> None:
    """A run's output where the executor keeps it (STATE/runs/ID/stdout)."""
    where = state_dir / "runs" / RUN
    where.mkdir(parents=True)
    (where / "stdout").write_text("PLAY [drain] ***\nok: [node-001]\n")


async def test_a_console_without_logins_says_why_run_output_needs_one_and_where_it_is(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    settings = engine_settings(tmp_path, fleet, nats_server.url, http="127.0.0.1:0")
    _kept_run(settings.state_dir)
    async with running_engine(settings, bus) as app:
        await wait_for(lambda: app.http_port, 30)
        base = f"http://127.0.0.1:{app.http_port}"
        async with aiohttp.ClientSession(base) as http, http.get(f"/console/runs/{RUN}") as r:
            assert r.url.path == "/console/login"
            page = await r.text()
    assert "Viewing needs no login" not in page
    assert "Run output can hold secrets" in page and "needs a login" in page
    assert "nobody can log in here" in page and 'id="token"' not in page, "no form to fail"
    assert f"history --run {RUN}" in page, "where the output can be read instead"


async def test_the_demos_login_leads_from_a_run_link_to_its_output(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    console, token = demo_console()
    settings = engine_settings(
        tmp_path, fleet, nats_server.url, http="127.0.0.1:0", console=console
    )
    _kept_run(settings.state_dir)
    async with running_engine(settings, bus) as app:
        await wait_for(lambda: app.http_port, 30)
        base = f"http://127.0.0.1:{app.http_port}"
        jar = aiohttp.CookieJar(unsafe=True)
        async with aiohttp.ClientSession(base, cookie_jar=jar) as http:
            async with http.get(f"/console/runs/{RUN}") as r:
                assert r.url.path == "/console/login" and 'id="token"' in await r.text()
                target = r.url.query["next"]
            form = {"token": token, "next": target}
            async with http.post("/console/login", data=form, headers={"Origin": base}) as r:
                assert r.status == 200 and r.url.path == f"/console/runs/{RUN}"
                assert "ok: [node-001]" in await r.text()
