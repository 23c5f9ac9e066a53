"""`gpuops demo`: embedded NATS, a simulated fleet with a scenario, the engine, real ansible-runner.

Simulated time runs `speed` times faster than the wall (an injected ScaledClock), so a
rule that needs a minute of sustained heat acts within seconds, unchanged. One drift
check runs during the scenario, as the scheduler would run it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import SecretStr
from rich.console import Console
from rich.table import Table

from gpuops import shipped
from gpuops.act.driftcheck import drift_check, publish_report
from gpuops.bus.conn import open_bus
from gpuops.clock import ScaledClock
from gpuops.models import AuditRecord, Reason
from gpuops.ops.commands import Caller
from gpuops.power.units import format_watts, parse_watts
from gpuops.record.metrics import by_label, total
from gpuops.settings import (
    ConsoleSettings,
    ConsoleToken,
    NatsSettings,
    SafetySettings,
    Settings,
)
from gpuops.sim.driver import SimDriver
from gpuops.sim.fleet import SimFleet, racks
from gpuops.sim.scenario import Fault, Said, Scenario, load_scenario
from gpuops.spine.app import App, enrol_inventory, load_world

# Which rule answers each fault, and how to tell the node recovered.
RULE_FOR = {
    "overheat": "gpu-overheat",
    "power_limit": "power-limit-below-policy",
    "xid": "xid-79-gpu-lost",
    "zombie": "probe-failed",
    "drift": "drift-safe-fix",
    "silent": "agent-silent",
    "ecc": "ecc-dbe-event",
}
DRIFT_CHECK_AT = 40.0
NOT_FAULTS = frozenset({"load", "job", "pod"})  # work the scenario starts, not faults
POWER_EVERY_S = 10.0  # how often the timeline shows a budgeted rack's power
DEMO_USER = "demo"  # who the demo's console login is (it reads; the ChatOps table grants no acts)


@dataclass
class Peak:
    """A budget a person set on a rack during the scenario, and what became of it."""

    group: str
    watts: float
    nodes: list[str]
    set_at: float
    over_at_set: float = 0.0
    under_at: float | None = None
    ended_at: float | None = None
    restored_at: float | None = None

    @property
    def settled(self) -> bool:
        """Under budget while it held, and back at policy after."""
        return self.under_at is not None and self.restored_at is not None


def _draw(fleet: SimFleet, nodes: list[str]) -> float:
    total = 0.0
    for node in nodes:
        sample = fleet.telemetry(node, time.time()) or {"data": {"gpus": []}}
        total += sum(g["power_w"] for g in sample["data"]["gpus"])
    return total


def _limits(fleet: SimFleet, nodes: list[str]) -> list[float]:
    return [g["power_limit_w"] for n in nodes for g in fleet.state(n)["gpus"]]


def _recovered(fleet: SimFleet, f: Fault) -> bool:
    s = fleet.state(f.node)
    g = s["gpus"][f.gpu]
    checks: dict[str, Callable[[], bool]] = {
        "overheat": lambda: bool(s["drained"]) and _temp(fleet, f) < 86.0,
        "power_limit": lambda: g["power_limit_w"] == 700.0,
        "xid": lambda: s["boots"] >= 1 and not {"lost", "slow_d2d"} & set(g["faults"]),
        "zombie": lambda: g["resets"] >= 1 and "zombie" not in g["faults"],
        "drift": lambda: g[f.params.get("setting", "persistence_mode")] is True,
        "ecc": lambda: g["resets"] >= 1,
    }
    check = checks.get(f.fault)
    return check() if check is not None else False


# Drops that only say "already being handled": the demo shows episodes, not samples.
QUIET_DROPS = frozenset(
    r.value
    for r in (
        Reason.COOLDOWN,
        Reason.LOCKED,
        Reason.SUPERSEDED,
        Reason.SILENCED,
        Reason.POWER_BUDGET,
    )
)


def _worth_saying(r: AuditRecord) -> bool:
    return r.body.get("decision", {}).get("reason") not in QUIET_DROPS


def _temp(fleet: SimFleet, f: Fault) -> float:
    sample = fleet.telemetry(f.node, time.time()) or {"data": {"gpus": []}}
    gpu = next((g for g in sample["data"]["gpus"] if g["index"] == f.gpu), None)
    return float(gpu["temp_c"]) if gpu else 999.0


@dataclass
class Track:
    """One injected fault and what became of it."""

    fault: Fault
    injected_at: float
    detected_at: float | None = None
    playbook: str = ""
    run: str = ""
    recovered_at: float | None = None
    held: bool = False  # the fleet breaker stopped its remediation (a storm)
    episode: dict[str, Any] | None = None  # the engine's record of the fault, once resolved

    @property
    def rule(self) -> str:
        return RULE_FOR[self.fault.fault]

    @property
    def settled(self) -> bool:
        """Done: recovered, or (no playbook for it) detected and handed to a person."""
        return (
            self.recovered_at is not None
            or self.held
            or (self.fault.fault == "silent" and self.detected_at is not None)
        )

    def outcome(self) -> str:
        if self.held and self.recovered_at is None:
            return "held by the fleet breaker"
        if self.recovered_at is not None and self.fault.fault == "overheat":
            return "isolated and cooled (needs a person)"
        if self.recovered_at is not None:
            return "recovered"
        if self.fault.fault == "silent" and self.detected_at is not None:
            return "notified (needs a person)"
        return "NOT recovered"


class _Demo:
    def __init__(self, fleet: SimFleet, console: Console, quiet: bool, t0: float) -> None:
        self.fleet, self.console, self.quiet, self.t0 = fleet, console, quiet, t0
        self.tracks: list[Track] = []
        self.peaks: list[Peak] = []
        self.said = 0  # the scenario's commands given so far
        self.commands = 0  # ... of these
        self.shown_power = float("-inf")

    def injected(self, fault: Fault, at: float) -> None:
        if fault.fault not in NOT_FAULTS:
            self.tracks.append(Track(fault, at))
        self.say(at, "fault", f"{fault.fault} on {fault.node}/{fault.gpu} {fault.params or ''}")

    def on_record(self, r: AuditRecord) -> None:
        episode = r.body.get("episode") if r.type == "note" else None
        for t in self.tracks:
            if episode and (episode["node"], episode["rule"]) == (t.fault.node, t.rule):
                t.episode = t.episode or episode
            if t.fault.node != r.node or (r.rule and r.rule != t.rule):
                continue
            if r.type == "decision" and r.rule == t.rule and t.detected_at is None:
                t.detected_at = r.at
            reason = r.body.get("decision", {}).get("reason") if r.type == "decision" else None
            if r.rule == t.rule and reason == Reason.BREAKER_OPEN.value:
                t.held = True
            if r.type == "run":
                t.playbook, t.run = r.body.get("playbook", ""), r.body.get("status", "")
        if r.type == "decision" and not _worth_saying(r):
            return  # a repeat of a fault already decided: the audit has it, people need not
        if r.type in ("decision", "run") or (
            r.type == "note" and r.summary.startswith(("running", "episode", "power"))
        ):
            self.say(r.at, r.type, r.summary)

    def budget(self, said: Said, reply: str, at: float) -> None:
        """A person's `power budget GROUP WATTS DURATION`: follow the rack from here."""
        self.say(at, "budget", reply)
        words = said.command.split()
        group = words[2]
        nodes = racks(self.fleet.nodes).get(group, [])
        if words[3] == "--end" or not nodes:
            return
        peak = Peak(group, parse_watts(words[3]), nodes, at)
        peak.over_at_set = _draw(self.fleet, nodes) - peak.watts
        self.peaks.append(peak)

    def poll_power(self, now: float) -> None:
        for p in self.peaks:
            draw = _draw(self.fleet, p.nodes)
            limits = _limits(self.fleet, p.nodes)
            if p.under_at is None and draw <= p.watts and sum(limits) <= p.watts:
                p.under_at = now
                self.say(
                    now,
                    "power",
                    f"{p.group} under budget: {format_watts(draw)} "
                    f"<= {format_watts(p.watts)} ({min(limits):.0f}-{max(limits):.0f} W)",
                )
            elif p.under_at is not None and p.restored_at is None and set(limits) == {700.0}:
                p.restored_at = now
                self.say(now, "power", f"{p.group} back at policy: every GPU at 700 W")
            elif now - self.shown_power >= POWER_EVERY_S and p.restored_at is None:
                self.say(
                    now,
                    "power",
                    f"{p.group} draws {format_watts(draw)} (budget "
                    f"{format_watts(p.watts)}), limits {format_watts(sum(limits))}",
                )
        if now - self.shown_power >= POWER_EVERY_S:
            self.shown_power = now

    def poll(self, now: float) -> None:
        self.poll_power(now)
        for t in self.tracks:
            if t.recovered_at is None and t.run == "successful" and _recovered(self.fleet, t.fault):
                t.recovered_at = now
                self.say(now, "recovered", f"{t.fault.node}/{t.fault.gpu} after {t.fault.fault}")

    def say(self, at: float, what: str, text: str) -> None:
        if not self.quiet:
            self.console.print(
                f"[dim]t+{at - self.t0:6.1f}s[/dim] {what:9} {text}", highlight=False
            )


async def run_demo(
    *,
    nodes: int,
    speed: float,
    json_summary: bool,
    timeout_s: float,
    state_dir: Path | None,
    console: Console,
    scenario: str = "demo",
    http: str = "127.0.0.1:0",
    linger_s: float = 0.0,
) -> bool:
    """Run the scenario to the end; True when every fault was handled.

    The engine serves the console (and /metrics) on `http` while the demo runs, and
    `linger_s` longer after the summary, so a person can look around.
    """
    wall0 = time.monotonic()
    root = (
        Path(tempfile.mkdtemp(prefix="gpuops-demo-")) if state_dir is None else state_dir / "demo"
    )
    if state_dir is not None:
        shutil.rmtree(root, ignore_errors=True)
    fleet = SimFleet.create(root / "sim", nodes, 8)
    # The scenarios expect the shipped rules and playbooks, not a site's edited ones.
    here = shipped.root()
    # The demo takes 2 of 16 nodes out of service on purpose; the default breaker (5% of
    # the fleet) would rightly stop the second. The storm scenario shows the breaker.
    # Simulated time runs `speed` times faster than ansible-runner on a loaded laptop: give
    # validation an hour of it, so a slow run is not taken for a probe that never answered.
    share = 0.2 if scenario == "demo" else SafetySettings().breaker_share
    safety = SafetySettings(breaker_share=share, validation_timeout_s=3600.0)
    console_settings, token = demo_console()
    settings = Settings(
        state_dir=root,
        rules_dir=here / "rules",
        playbooks_dir=here / "playbooks",
        inventory=root / "sim" / "inventory",
        tick_s=0.2,
        safety=safety,
        http=http,
        console=console_settings,
    )
    rules, inventory = load_world(settings)
    plan = load_scenario(scenario, fleet.nodes)
    clock = ScaledClock(speed)
    demo = _Demo(fleet, console, json_summary, clock.now())
    demo.commands = len(plan.commands)
    if not json_summary:
        console.print(
            f"[bold]gpuops demo[/bold]: {nodes} nodes x 8 H200, {len(rules.rules)} rules, "
            f"scenario {plan.name!r}, time x{speed:g}; state in {root}"
        )
    enrol_inventory(settings, inventory)
    async with open_bus(NatsSettings(), root, name="gpuops-demo") as bus:
        app = App(settings=settings, bus=bus, clock=clock, rules=rules, inventory=inventory)
        app.auditor.listeners.append(demo.on_record)
        driver = SimDriver(fleet, bus, clock, plan, on_inject=demo.injected, keys=app.keys)
        engine = asyncio.create_task(app.run())
        feeder = asyncio.create_task(driver.run(app.stop))
        url = await _console_url(app, http)
        if not json_summary:
            console.print(
                f"console: {url} (served while the demo runs; run output needs a login: "
                f"token {token})",
                highlight=False,
            )
        checked = await _until_done(
            demo,
            clock,
            wall0 + timeout_s,
            _faults(plan),
            lambda: _drift_check(app, inventory, settings, clock, demo),
            lambda: _say(app, demo, plan, clock),
        )
        states = await _node_states(app, demo, wall0 + timeout_s)
        if linger_s > 0:
            if not json_summary:
                console.print(f"console stays up for {linger_s:g}s at {url} (Ctrl-C ends it)")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(app.stop.wait(), linger_s)
        app.stop.set()
        await asyncio.gather(engine, feeder)
    ok = (
        len(demo.tracks) == _faults(plan)
        and all(t.settled for t in demo.tracks)
        and len(demo.peaks) == sum(1 for c in plan.commands if "--end" not in c.command)
        and all(p.settled for p in demo.peaks)
    )
    summary = _summary(states, demo, app, driver, time.monotonic() - wall0, ok, checked)
    if json_summary:
        console.print_json(json.dumps(summary))
    else:
        _print_summary(console, summary)
    if state_dir is None:
        shutil.rmtree(root, ignore_errors=True)
    return ok


def _faults(plan: Scenario) -> int:
    return sum(1 for f in plan.faults if f.fault not in NOT_FAULTS)


async def _say(app: App, demo: _Demo, plan: Scenario, clock: ScaledClock) -> None:
    """The scenario's commands that are due, given as a person would (CLI, user demo)."""
    now = clock.now()
    while demo.said < len(plan.commands) and now - demo.t0 >= plan.commands[demo.said].at:
        said = plan.commands[demo.said]
        demo.said += 1
        reply = await app.commands().execute(said.command, Caller.of("cli", "demo"))
        if said.command.startswith("power budget"):
            demo.budget(said, reply, now)
        else:
            demo.say(now, "command", f"{said.command}: {reply.splitlines()[0]}")


def demo_console() -> tuple[ConsoleSettings, str]:
    """The demo's console: open to read on loopback, and a login made for this run (its
    token printed with the URL) so a run's output, which needs one, can be read."""
    token = secrets.token_hex(24)
    login = ConsoleToken(user=DEMO_USER, token=SecretStr(token))
    return ConsoleSettings(tokens=(login,)), token


async def _console_url(app: App, http: str) -> str:
    """The console's address once the engine listens (it picks the port for `:0`)."""
    for _ in range(200):
        if app.http_port:
            break
        await asyncio.sleep(0.05)
    host = http.rpartition(":")[0] or "127.0.0.1"
    host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return f"http://{host}:{app.http_port}/console/fleet"


async def _drift_check(
    app: App, inventory: Any, settings: Settings, clock: ScaledClock, demo: _Demo
) -> dict[str, Any]:
    report = await drift_check(inventory, settings.playbooks_dir, clock)
    await publish_report(app.engine.stores.auditor.publisher, report)
    demo.say(
        report.ended,
        "drift",
        f"check of {len(report.hosts)} hosts: drifted {report.drifted or 'none'}",
    )
    return report.summary()


async def _node_states(app: App, demo: _Demo, deadline: float) -> dict[str, str]:
    """Wait (within the deadline) for validated nodes to return to service; their states."""
    nodes = sorted({t.fault.node for t in demo.tracks})
    while True:
        states = {n: (await app.engine.states.get(n)).state.value for n in nodes}
        settling = [
            n for n, st in states.items() if st in ("remediating", "validating", "quarantined")
        ]
        if not settling or time.monotonic() >= deadline:
            return states
        await asyncio.sleep(0.2)


async def _until_done(
    demo: _Demo, clock: ScaledClock, deadline: float, expected: int, check: Any, say: Any
) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    while time.monotonic() < deadline:
        await say()
        if not summary and clock.now() - demo.t0 >= DRIFT_CHECK_AT:
            summary = await check()
        demo.poll(clock.now())
        faults_done = len(demo.tracks) == expected and all(t.settled for t in demo.tracks)
        peaks_done = demo.said == demo.commands and all(p.settled for p in demo.peaks)
        if summary and faults_done and peaks_done:
            break
        await asyncio.sleep(0.2)
    return summary


def _summary(
    states: dict[str, str],
    demo: _Demo,
    app: App,
    driver: SimDriver,
    wall: float,
    ok: bool,
    drift: dict[str, Any],
) -> dict[str, Any]:
    rows = [
        {
            "fault": t.fault.fault,
            "node": t.fault.node,
            "gpu": t.fault.gpu,
            "rule": t.rule,
            "detected_after_s": _delta(t.injected_at, t.detected_at),
            "playbook": t.playbook,
            "run": t.run or "none",
            **_episode_times(t),
            "recovered_after_s": _delta(t.injected_at, t.recovered_at),
            "outcome": t.outcome(),
        }
        for t in demo.tracks
    ]
    m = app.engine.metrics
    return {
        "ok": ok,
        "wall_s": round(wall, 1),
        "telemetry_published": driver.stats.telemetry,
        "health_published": driver.stats.health,
        "events_processed": int(total(m.events)),
        "decisions": {k: int(v) for k, v in by_label(m.decisions).items()},
        "intents": int(total(m.intents)),
        "runs": int(total(m.runs)),
        "node_states": states,
        "drift_check": drift,
        "faults": rows,
        "budgets": [
            {
                "group": p.group,
                "budget_w": p.watts,
                "over_at_set_w": round(p.over_at_set, 1),
                "under_after_s": _delta(p.set_at, p.under_at),
                "restored_after_s": _delta(p.set_at, p.restored_at),
            }
            for p in demo.peaks
        ],
    }


def _episode_times(t: Track) -> dict[str, float | None]:
    """Decide, run and recover times from the engine's own record of the fault."""
    ep = t.episode or {}
    return {
        "decided_after_s": _delta(t.injected_at, ep.get("decided_at")),
        "run_s": _delta(ep.get("run_started"), ep.get("run_ended")),
        "episode_resolved_after_s": _delta(t.injected_at, ep.get("resolved_at")),
    }


def _delta(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(b - a, 1)


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value}s"


def _print_summary(console: Console, s: dict[str, Any]) -> None:
    table = Table(
        "fault",
        "node/gpu",
        "rule",
        "detected",
        "decided",
        "playbook",
        "run",
        "recovered",
        "outcome",
        "node state",
        title="Summary (simulated seconds after the fault)",
    )
    for r in s["faults"]:
        run = r["run"] if r["run_s"] is None else f"{r['run']} in {r['run_s']}s"
        table.add_row(
            r["fault"],
            f"{r['node']}/{r['gpu']}",
            r["rule"],
            _secs(r["detected_after_s"]),
            _secs(r["decided_after_s"]),
            r["playbook"] or "-",
            run,
            _secs(r["episode_resolved_after_s"]),
            r["outcome"],
            s["node_states"].get(r["node"], "?"),
        )
    console.print(table)
    for b in s.get("budgets", []):
        console.print(
            f"budget {b['group']} {format_watts(b['budget_w'])}: "
            f"{format_watts(b['over_at_set_w'])} over when set, under it after "
            f"{_secs(b['under_after_s'])}, back at policy {_secs(b['restored_after_s'])} "
            "after it was set",
            highlight=False,
        )
    verdict = (
        "[green]every fault handled[/green]" if s["ok"] else "[red]not every fault handled[/red]"
    )
    console.print(
        f"events processed {s['events_processed']} (telemetry {s['telemetry_published']}, "
        f"health {s['health_published']}), decisions {s['decisions']}, runs {s['runs']}, "
        f"wall {s['wall_s']}s: {verdict}"
    )
