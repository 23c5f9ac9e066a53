"""`gpuops demo`: embedded NATS, a simulated fleet with faults, the engine, real ansible-runner.

Simulated time runs `speed` times faster than the wall (an injected ScaledClock), so a
rule that needs a minute of sustained heat acts within seconds, unchanged.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from engine.app import App, load_world
from engine.bus.conn import Bus, open_bus
from engine.clock import ScaledClock
from engine.intake.decode import event_subject
from engine.models import EVENT_ADAPTER, AuditRecord
from engine.settings import NatsSettings, Settings, checkout_root
from engine.sim.fleet import SimFleet, envelope


@dataclass
class Fault:
    """One fault of the demo scenario and what became of it."""

    name: str
    node: str
    gpu: int
    at: float
    rule: str
    recovered: Callable[[SimFleet, Fault], bool]
    params: dict[str, Any] = field(default_factory=dict)
    injected_at: float | None = None
    detected_at: float | None = None
    playbook: str = ""
    run_status: str = ""
    recovered_at: float | None = None


def _cooled(fleet: SimFleet, f: Fault) -> bool:
    sample = fleet.telemetry(f.node, time.time())
    gpu = next(g for g in (sample or {}).get("data", {}).get("gpus", []) if g["index"] == f.gpu)
    return bool(fleet.state(f.node)["drained"]) and gpu["temp_c"] < gpu["temp_slowdown_c"] - 3


def _power_restored(fleet: SimFleet, f: Fault) -> bool:
    return bool(fleet.state(f.node)["gpus"][f.gpu]["power_limit_w"] == 700.0)


def _gpu_back(fleet: SimFleet, f: Fault) -> bool:
    state = fleet.state(f.node)
    return state["boots"] >= 1 and not state["gpus"][f.gpu]["faults"].get("lost")


def scenario(nodes: list[str]) -> list[Fault]:
    """Overheat, a lowered power limit and a lost GPU, on different nodes."""
    pick = [nodes[i % len(nodes)] for i in (1, 2, 3)]
    return [
        Fault("overheat", pick[0], 3, 10.0, "gpu-overheat", _cooled),
        Fault(
            "power limit 400 W",
            pick[1],
            5,
            10.0,
            "power-limit-below-policy",
            _power_restored,
            {"watts": 400},
        ),
        Fault("XID 79", pick[2], 1, 20.0, "xid-79-gpu-lost", _gpu_back),
    ]


class _Sim:
    """Publishes what the fleet's agents would, and injects the scenario's faults."""

    def __init__(self, fleet: SimFleet, bus: Bus, clock: ScaledClock, faults: list[Fault]) -> None:
        self.fleet, self.bus, self.clock, self.faults = fleet, bus, clock, faults
        self.t0 = clock.now()
        self.published = 0

    async def run(self, stop: asyncio.Event) -> None:
        tick = 0
        while not stop.is_set():
            now = self.clock.now()
            await self._inject(now)
            for node in self.fleet.nodes:
                await self._send(self.fleet.telemetry(node, now))
                if tick % 10 == 0:
                    await self._send(self.fleet.heartbeat(node, now, tick))
            tick += 1
            await asyncio.sleep(1.0 / self.clock.factor)

    async def _inject(self, now: float) -> None:
        for f in self.faults:
            if f.injected_at is None and now - self.t0 >= f.at:
                f.injected_at = now
                if f.name == "XID 79":
                    self.fleet.inject(f.node, "lost", f.gpu, at=now)
                    await self._send(
                        envelope(
                            "xid",
                            f.node,
                            now,
                            {"gpu": f.gpu, "xid": 79, "message": "GPU has fallen off the bus."},
                        )
                    )
                elif f.name.startswith("power"):
                    self.fleet.inject(f.node, "power_limit", f.gpu, at=now, **f.params)
                else:
                    self.fleet.inject(f.node, "overheat", f.gpu, at=now)

    async def _send(self, event: dict[str, Any] | None) -> None:
        if event is None:
            return
        subject = event_subject(EVENT_ADAPTER.validate_python(event))
        await self.bus.js.publish(
            subject, json.dumps(event).encode(), headers={"Nats-Msg-Id": event["id"]}
        )
        self.published += 1


def _watch(
    faults: list[Fault], console: Console, t0: float, quiet: bool
) -> Callable[[AuditRecord], None]:
    def on_record(r: AuditRecord) -> None:
        f = next((f for f in faults if f.node == r.node and (not r.rule or f.rule == r.rule)), None)
        if r.type == "decision" and f is not None and f.rule == r.rule:
            accepted = r.body.get("decision", {}).get("accepted")
            if accepted and f.detected_at is None:
                f.detected_at = r.at
        if r.type == "run" and f is not None:
            f.playbook, f.run_status = r.body.get("playbook", ""), r.body.get("status", "")
        if not quiet and r.type in ("decision", "run", "note"):
            console.print(f"[dim]t+{r.at - t0:6.1f}s[/dim] {r.type:8} {r.summary}", highlight=False)

    return on_record


async def run_demo(
    *,
    nodes: int,
    speed: float,
    json_summary: bool,
    timeout_s: float,
    state_dir: Path | None,
    console: Console,
) -> bool:
    """Run the scenario to the end; True when every fault was detected, fixed and recovered."""
    wall0 = time.monotonic()
    root = (
        Path(tempfile.mkdtemp(prefix="gpuops-demo-")) if state_dir is None else state_dir / "demo"
    )
    if state_dir is not None:
        shutil.rmtree(root, ignore_errors=True)
    fleet = SimFleet.create(root / "sim", nodes, 8)
    here = checkout_root()
    settings = Settings(
        state_dir=root,
        rules_dir=here / "rules",
        playbooks_dir=here / "playbooks",
        inventory=root / "sim" / "inventory",
        tick_s=0.2,
    )
    rules, inventory = load_world(settings)
    clock = ScaledClock(speed)
    faults = scenario(fleet.nodes)
    quiet = json_summary
    if not quiet:
        console.print(
            f"[bold]gpuops demo[/bold]: {nodes} nodes x 8 H200, {len(rules.rules)} rules, "
            f"time x{speed:g}; state in {root}"
        )
    async with open_bus(NatsSettings(), root, name="gpuops-demo") as bus:
        app = App(settings=settings, bus=bus, clock=clock, rules=rules, inventory=inventory)
        app.auditor.listeners.append(_watch(faults, console, clock.now(), quiet))
        sim = _Sim(fleet, bus, clock, faults)
        engine = asyncio.create_task(app.run())
        feeder = asyncio.create_task(sim.run(app.stop))
        await _until_done(fleet, faults, clock, wall0 + timeout_s)
        app.stop.set()
        await asyncio.gather(engine, feeder)
    ok = all(f.recovered_at is not None for f in faults)
    summary = _summary(faults, app, sim, time.monotonic() - wall0, ok)
    if json_summary:
        console.print_json(json.dumps(summary))
    else:
        _print_summary(console, summary)
    if state_dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return ok


async def _until_done(
    fleet: SimFleet, faults: list[Fault], clock: ScaledClock, deadline: float
) -> None:
    while time.monotonic() < deadline:
        for f in faults:
            if f.recovered_at is None and f.run_status and f.recovered(fleet, f):
                f.recovered_at = clock.now()
        if all(f.recovered_at is not None for f in faults):
            return
        await asyncio.sleep(0.2)


def _summary(faults: list[Fault], app: App, sim: _Sim, wall: float, ok: bool) -> dict[str, Any]:
    rows = []
    for f in faults:
        rows.append(
            {
                "fault": f.name,
                "node": f.node,
                "gpu": f.gpu,
                "rule": f.rule,
                "detected_after_s": _delta(f.injected_at, f.detected_at),
                "playbook": f.playbook,
                "run": f.run_status or "none",
                "recovered_after_s": _delta(f.injected_at, f.recovered_at),
                "outcome": "recovered" if f.recovered_at else "NOT recovered",
            }
        )
    p = app.pipeline
    return {
        "ok": ok,
        "wall_s": round(wall, 1),
        "events_published": sim.published,
        "events_processed": sum(p.events.values()),
        "decisions": dict(p.decisions),
        "intents": p.intents,
        "runs": len(app.executor.outcomes) if app.executor else 0,
        "faults": rows,
    }


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 1)


def _print_summary(console: Console, s: dict[str, Any]) -> None:
    table = Table(
        "fault",
        "node/gpu",
        "rule",
        "detected after",
        "playbook",
        "run",
        "outcome",
        title="Summary (times in simulated seconds)",
    )
    for r in s["faults"]:
        det = "-" if r["detected_after_s"] is None else f"{r['detected_after_s']}s"
        table.add_row(
            r["fault"],
            f"{r['node']}/{r['gpu']}",
            r["rule"],
            det,
            r["playbook"],
            r["run"],
            r["outcome"],
        )
    console.print(table)
    console.print(
        f"events published {s['events_published']}, processed {s['events_processed']}, "
        f"decisions {s['decisions']}, runs {s['runs']}, wall {s['wall_s']}s: "
        + (
            "[green]all faults recovered[/green]"
            if s["ok"]
            else "[red]not all faults recovered[/red]"
        )
    )
