"""Issue 13: who changes things from the CLI is the NATS user of the connection, checked
against the ChatOps permission table by the engine; the engine says whether it runs.

A real engine with its embedded, authenticated nats-server; commands go the way
`gpuops approve` sends them (`ask_engine` on the operator's own command subject).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from gpuops.bus.auth import operators_dir
from gpuops.bus.conn import Bus, join_bus, open_bus
from gpuops.clock import SystemClock
from gpuops.decide.breaker import BreakerState
from gpuops.models import Match
from gpuops.ops.cmdwire import CommandError, CommandUsageError, Refused, ask_engine
from gpuops.ops.commands import Commands
from gpuops.record.approvals import ApprovalStatus
from gpuops.record.audit import read_audit
from gpuops.settings import ChatopsSettings, NatsSettings
from gpuops.sim.fleet import SimFleet
from gpuops.spine.app import App

from tests.conftest import engine_settings, running_engine, wait_for
from tests.support import decide

pytestmark = pytest.mark.integration
MALLORY_PASSWORD = "mallory-has-her-own-password"


@pytest.fixture
async def engine(tmp_path: Path, fleet: SimFleet) -> AsyncIterator[tuple[App, Path]]:
    """An engine on its embedded server; approve is granted to `operator` only, and a
    second operator user, mallory, exists on the server."""
    state = tmp_path / "state"
    operators_dir(state).mkdir(parents=True)
    (operators_dir(state) / "mallory.json").write_text(
        json.dumps({"user": "mallory", "password": MALLORY_PASSWORD})
    )
    settings = engine_settings(
        tmp_path,
        fleet,
        "",
        nats={},
        chatops={"permissions": {"approve": {"users": ["cli:operator"]}}},
    )
    async with (
        open_bus(settings.nats, state) as bus,
        running_engine(settings, bus) as app,
    ):
        await wait_for(lambda: _engine_up(bus), 30)
        yield app, state


async def _engine_up(bus: Bus) -> bool:
    return (await _commands(bus).engine(SystemClock().now())).running


def _commands(bus: Bus) -> Commands:
    """The CLI's read-only view (no inventory), as `gpuops status` builds it."""
    return Commands.over_bus(bus, SystemClock(), None, ChatopsSettings())


async def _pending_approval(app: App, node: str) -> str:
    """Open an approval the way a half-open breaker does; its id."""
    now = app.clock.now()
    await app.engine.breaker.set_state(BreakerState.HALF_OPEN, "test", now, "test")
    match = Match(
        rule="gpu-overheat",
        kind="telemetry",
        node=node,
        gpu=3,
        key=f"{node}/3",
        event_id=f"e-{node}-{now}",
        event_ts=now,
        at=now,
        facts={"node": node, "gpu": 3, "temp_c": 88.0},
    )
    await decide(app.engine.pipeline, match)
    [record] = [r for r in await app.engine.approvals.all() if r.node == node]
    return record.id


async def test_a_cli_approve_records_the_nats_user_and_a_user_not_granted_is_refused(
    engine: tuple[App, Path],
) -> None:
    app, state = engine
    approval = await _pending_approval(app, "node-001")
    mallory_settings = NatsSettings(url=app.bus.url, user="mallory", password=MALLORY_PASSWORD)
    mallory = await join_bus(mallory_settings, state)
    try:
        assert mallory.user == "mallory"
        with pytest.raises(Refused, match="cli:mallory may not run 'approve'"):
            await ask_engine(mallory, "approve", [approval])
        # Nor can she speak as someone else: the server keeps her off their subject.
        errors: list[str] = []

        async def collect(exc: Exception) -> None:
            errors.append(str(exc))

        raw = await nats.connect(
            app.bus.url,
            user="mallory",
            password=MALLORY_PASSWORD,
            error_cb=collect,
            allow_reconnect=False,
        )
        try:
            with pytest.raises(TimeoutError):
                await raw.request("gpuops.cmd.operator.approve", b'{"args": []}', timeout=2)
            assert any("permissions violation" in e for e in errors), errors
        finally:
            await raw.close()
    finally:
        await mallory.close()
    assert (await app.engine.approvals.get(approval)).status is ApprovalStatus.PENDING  # type: ignore[union-attr]

    operator = await join_bus(NatsSettings(), state)
    try:
        assert operator.user == "operator"
        reply = await ask_engine(operator, "approve", [approval])
        assert reply.startswith(f"approved {approval}")
    finally:
        await operator.close()
    record = await app.engine.approvals.get(approval)
    assert record is not None and record.by == "cli:operator"
    notes = [r.summary async for r in read_audit(app.bus.js) if r.type == "note"]
    assert any(n.startswith(f"cli:operator: approve {approval}") for n in notes), notes
    assert any("refused approve from cli:mallory" in n for n in notes), notes


async def test_bad_cli_commands_say_why_with_a_kind_the_cli_maps_to_its_exit_code(
    engine: tuple[App, Path],
) -> None:
    app, state = engine
    approval = await _pending_approval(app, "node-002")
    bus = await join_bus(NatsSettings(), state)
    try:
        with pytest.raises(CommandUsageError, match=r"silence: missing arguments \(usage"):
            await ask_engine(bus, "silence", ["node:node-001"])
        with pytest.raises(CommandUsageError, match="bad duration 'soon'"):
            await ask_engine(bus, "silence", ["node:node-001", "soon", "fan swap"])
        with pytest.raises(CommandError, match=r"'node-999' is not in the inventory.*--force"):
            await ask_engine(bus, "silence", ["node:node-999", "1h", "typo?"])
        with pytest.raises(CommandError, match=r"group 'gpu-typo' is not in the inventory"):
            await ask_engine(bus, "silence", ["group:gpu-typo", "1h", "typo?"])
        whole = await ask_engine(bus, "silence", ["group:all", "10m", "maintenance"])
        assert whole.startswith("silence ") and "group:all" in whole
        forced = await ask_engine(bus, "silence", ["node:node-999", "1h", "joins soon", "--force"])
        assert forced.startswith("silence ") and "(joins soon)" in forced
        with pytest.raises(CommandError, match="no approval 'nope'"):
            await ask_engine(bus, "deny", ["nope"])
        assert (await ask_engine(bus, "deny", [approval])).startswith("denied")
        with pytest.raises(CommandError, match=f"approval {approval} is already denied"):
            await ask_engine(bus, "approve", [approval])
        ran = await app.engine.approvals.get(await _pending_approval(app, "node-001"))
        assert ran is not None and await app.engine.approvals.mark(ran, ApprovalStatus.EXECUTED)
        with pytest.raises(CommandError, match=f"approval {ran.id} is already executed"):
            await ask_engine(bus, "approve", [ran.id])
    finally:
        await bus.close()
    silences = await app.engine.silences.all()
    assert sorted((s.target, s.by) for s in silences) == [
        ("group:all", "cli:operator"),
        ("node:node-999", "cli:operator"),
    ]


async def test_heartbeat_says_up_while_the_engine_runs_and_stopped_after(
    tmp_path: Path, fleet: SimFleet
) -> None:
    settings = engine_settings(tmp_path, fleet, "", nats={})
    async with open_bus(settings.nats, tmp_path / "state") as bus:
        async with running_engine(settings, bus):
            await wait_for(lambda: _engine_up(bus), 30)
            state = await _commands(bus).status()
            assert state["engine"]["running"] is True
            assert state["engine"]["line"].startswith("engine up since ")
            assert state["engine"]["heartbeat"]["hosts"] == 2
            assert state["counts"]["healthy"] == 2, "the hosts count comes from the heartbeat"
        [beat] = await _commands(bus).heartbeats.all()
        assert beat.stopped is not None
        engine = await _commands(bus).engine(SystemClock().now())
        assert not engine.running and engine.line.startswith("no engine running (stopped ")
