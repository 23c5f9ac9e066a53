"""Approvals end to end in a running engine: approve decides the match again (and closes a
half-open breaker), deny and timeout run nothing; notifications retry with backoff."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from gpuops.bus.conn import ACTIONS, Bus
from gpuops.bus.server import EmbeddedNats
from gpuops.clock import ManualClock
from gpuops.decide.breaker import BreakerState
from gpuops.models import Match, Reason
from gpuops.ops.commands import Caller
from gpuops.record.approvals import SETTLED_KEPT_S, ApprovalStatus
from gpuops.record.notify import Notifier, Webhook
from gpuops.sim.fleet import SimFleet
from pydantic import SecretStr

from tests.conftest import calls, counted, engine_settings, running_engine, wait_for
from tests.support import decide

pytestmark = pytest.mark.integration
ALICE = Caller.of("cli", "alice")


def _overheat(node: str, t: float) -> Match:
    return Match(
        rule="gpu-overheat",
        kind="telemetry",
        node=node,
        gpu=3,
        key=f"{node}/3",
        event_id=f"e-{node}-{t}",
        event_ts=t,
        at=t,
        facts={"node": node, "gpu": 3, "temp_c": 88.0},
    )


async def test_half_open_breaker_action_runs_after_approval_and_closes_it(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    settings = engine_settings(tmp_path, fleet, nats_server.url)
    async with running_engine(settings, bus) as app:
        engine = app.engine
        await engine.breaker.set_state(BreakerState.HALF_OPEN, "test", app.clock.now(), "alice")
        await decide(engine.pipeline, _overheat("node-001", app.clock.now()))
        assert counted(engine.metrics.decisions, Reason.APPROVAL_PENDING.value) == 1
        [record] = await engine.approvals.all()
        assert (await bus.js.stream_info(ACTIONS)).state.messages == 0, (
            "nothing runs before approval"
        )
        assert any(
            m["topic"] == "approval needed" and record.id in m["text"] for m in app.notifier.sent
        )
        reply = await app.commands().run(f"approve {record.id}", ALICE)
        assert reply.startswith(f"approved {record.id}")
        await wait_for(
            lambda: any("state=drain" in " ".join(c) for c in calls(fleet, "node-001", "scontrol")),
            30,
        )
        state, _ = await engine.breaker.get()
        assert state.state is BreakerState.CLOSED and "alice" in state.why


async def test_denied_and_expired_approvals_run_nothing(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    settings = engine_settings(tmp_path, fleet, nats_server.url)
    clock = ManualClock(1_800_000_000.0)
    async with running_engine(settings, bus, clock) as app:
        engine = app.engine
        await engine.breaker.set_state(BreakerState.HALF_OPEN, "test", clock.now(), "alice")
        await decide(engine.pipeline, _overheat("node-001", clock.now()))
        await decide(engine.pipeline, _overheat("node-002", clock.now()))
        first, second = sorted(await engine.approvals.all(), key=lambda r: r.node)
        assert (await app.commands().run(f"deny {first.id}", ALICE)).startswith("denied")
        clock.advance(settings.safety.approval_timeout_s + 1)
        await engine.answers.settle()
        statuses = {r.node: r.status for r in await engine.approvals.all()}
        assert statuses == {"node-001": ApprovalStatus.DENIED, "node-002": ApprovalStatus.EXPIRED}
        too_late = await app.commands().run(f"approve {second.id}", ALICE)
        assert "is already expired" in too_late
        assert any(m["topic"] == "approval expired" for m in app.notifier.sent)
    assert (await bus.js.stream_info(ACTIONS)).state.messages == 0
    assert calls(fleet, "node-001") == [] and calls(fleet, "node-002") == []


async def test_settled_approvals_are_deleted_a_day_after_and_a_pending_one_is_kept(
    tmp_path: Path, bus: Bus, fleet: SimFleet, nats_server: EmbeddedNats
) -> None:
    settings = engine_settings(tmp_path, fleet, nats_server.url)
    clock = ManualClock(1_800_000_000.0)
    async with running_engine(settings, bus, clock) as app:
        engine = app.engine
        await engine.breaker.set_state(BreakerState.HALF_OPEN, "test", clock.now(), "alice")
        await decide(engine.pipeline, _overheat("node-001", clock.now()))
        [expired] = await engine.approvals.all()
        clock.advance(settings.safety.approval_timeout_s + SETTLED_KEPT_S - 60)
        await decide(engine.pipeline, _overheat("node-002", clock.now()))
        await engine.answers.settle()
        assert {r.node: r.status for r in await engine.approvals.all()} == {
            "node-001": ApprovalStatus.EXPIRED,
            "node-002": ApprovalStatus.PENDING,
        }
        clock.advance(61)
        await engine.answers.settle()
        assert expired.id not in await engine.approvals.ids()
        [pending] = await engine.approvals.all()
        assert pending.node == "node-002" and pending.status is ApprovalStatus.PENDING
        reply = await app.commands().run(f"approve {pending.id}", ALICE)
        assert reply.startswith(f"approved {pending.id}")
        gone = await app.commands().run(f"approve {expired.id}", ALICE)
        assert f"no approval {expired.id!r}" in gone


async def test_notifications_retry_with_backoff_until_delivered() -> None:
    attempts: list[dict[str, Any]] = []

    async def flaky(request: web.Request) -> web.Response:
        attempts.append(await request.json())
        return web.Response(status=503 if len(attempts) < 3 else 200)

    app = web.Application()
    app.add_routes([web.post("/hook", flaky)])
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/hook"
    try:
        notifier = Notifier([Webhook("mattermost", SecretStr(url), "ops")], backoff_s=0.05)
        notifier.notify("breaker open", "6 nodes")
        await asyncio.wait_for(notifier.drain(), 10)
    finally:
        await runner.cleanup()
    assert len(attempts) == 3 and notifier.failed == 0
    assert attempts[-1] == {"text": "[gpuops] breaker open: 6 nodes", "channel": "ops"}
