"""Entry points the CLI runs: the engine, publishing events, reading the audit trail."""

from __future__ import annotations

import json
import logging
from typing import Any

from engine.app import App, load_world
from engine.bus.conn import open_bus
from engine.clock import Clock, SystemClock
from engine.intake.decode import event_subject
from engine.models import EVENT_ADAPTER, AuditRecord, subject_for
from engine.record.audit import read_audit
from engine.settings import Settings

log = logging.getLogger(__name__)


async def run_engine(settings: Settings, clock: Clock | None = None) -> None:
    """Load rules and inventory (failing fast), connect, and run until stopped."""
    rules, inventory = load_world(settings)
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    async with open_bus(settings.nats, settings.state_dir, name="gpuops-engine") as bus:
        app = App(
            settings=settings,
            bus=bus,
            clock=clock or SystemClock(),
            rules=rules,
            inventory=inventory,
        )
        await app.run()


async def publish_lines(settings: Settings, lines: list[bytes]) -> tuple[int, int]:
    """Publish JSON-lines events to their subjects; lines that are not events are skipped."""
    sent = bad = 0
    subject: str | None
    async with open_bus(settings.nats, settings.state_dir, name="gpuops-publish") as bus:
        for line in lines:
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                subject = event_subject(EVENT_ADAPTER.validate_python(raw))
                msg_id = str(raw.get("id"))
            except ValueError:
                # Published anyway to the kind's subject when it has one: the engine's
                # dead-letter path is where a bad event is meant to end up and be seen.
                subject, msg_id = _fallback_subject(line), None
                bad += 1
                if subject is None:
                    continue
            headers = {"Nats-Msg-Id": msg_id} if msg_id else None
            await bus.js.publish(subject, line, headers=headers)
            sent += 1
    return sent, bad


def _fallback_subject(line: bytes) -> str | None:
    try:
        raw = json.loads(line)
    except ValueError:
        raw = None
    if not isinstance(raw, dict):
        return subject_for("unknown", "unknown")
    return subject_for(str(raw.get("kind", "unknown")), str(raw.get("node", "unknown")))


async def audit_records(settings: Settings, node: str | None) -> list[AuditRecord]:
    """Every audit record (for one node, or all), oldest first."""
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    async with open_bus(settings.nats, settings.state_dir, name="gpuops-history") as bus:
        return [r async for r in read_audit(bus.js, node)]


async def drive_fleet(
    settings: Settings, fleet: Any, seconds: float, scenario: str | None
) -> list[str]:
    """Publish a fleet's events in real time for `seconds`; report whether it kept up."""
    import asyncio

    from engine.clock import ScaledClock
    from engine.sim.driver import SimDriver
    from engine.sim.scenario import load_scenario

    plan = load_scenario(scenario, fleet.nodes) if scenario else None
    async with open_bus(settings.nats, settings.state_dir, name="gpuops-simulate") as bus:
        driver = SimDriver(fleet, bus, ScaledClock(1.0), plan, probe_s=0 if plan is None else 30.0)
        stop = asyncio.Event()
        task = asyncio.create_task(driver.run(stop))
        await asyncio.sleep(seconds)
        stop.set()
        await task
    st = driver.stats
    gpus = fleet.gpus * len(fleet.nodes)
    return [
        f"ticks={st.ticks} late_ticks={st.late_ticks} busy={st.busy_s:.1f}s of {seconds:.0f}s",
        f"telemetry_msgs={st.telemetry} health_msgs={st.health} faults_injected={len(st.injected)}",
        f"nodes={len(fleet.nodes)} gpus={gpus} telemetry_per_s={st.telemetry / seconds:.0f} "
        f"gpu_samples_per_s={st.telemetry * fleet.gpus / seconds:.0f} "
        f"tick_busy_ms={1000 * st.busy_s / max(st.ticks, 1):.0f}",
        f"telemetry_dropped={st.telemetry_dropped} health_retries={st.health_retries} "
        f"health_unsent={st.health_unsent}",
    ]


async def with_commands(settings: Settings, use: Any) -> Any:
    """Connect, build the command set over the inventory, and run `use(commands)`."""
    from engine.commands import Commands
    from engine.inventory import load_inventory

    inventory = load_inventory(settings.inventory)
    settings.state_dir.mkdir(parents=True, exist_ok=True)
    async with open_bus(settings.nats, settings.state_dir, name="gpuops-cli") as bus:
        return await use(Commands(bus, SystemClock(), inventory, settings.chatops))


async def run_drift_check(
    settings: Settings, group: str, progress: Any, publish: bool = True
) -> Any:
    """One drift check now; its events and summary go to the bus unless `publish` is off."""
    from engine.act.driftcheck import drift_check, publish_report
    from engine.inventory import load_inventory
    from engine.record.audit import Auditor

    inventory = load_inventory(settings.inventory)
    clock = SystemClock()
    report = await drift_check(
        inventory,
        settings.playbooks_dir,
        clock,
        group=group,
        batch_size=settings.drift.batch_size,
        forks=settings.drift.forks,
        progress=progress,
    )
    if publish:
        settings.state_dir.mkdir(parents=True, exist_ok=True)
        async with open_bus(settings.nats, settings.state_dir, name="gpuops-drift") as bus:
            await publish_report(bus.js, report)
            await Auditor(bus.js).note(
                clock.now(), "", report.line(), {"drift_check": report.summary()}
            )
    return report
