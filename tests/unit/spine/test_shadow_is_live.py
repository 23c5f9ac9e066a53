"""Shadow mode is the live engine: one recording through `Shadow` (what `gpuops replay` and
`gpuops test-rules` run) and through the live engine's parts, driven as `App` and the
executor drive them (the pipeline's entry, the engine's tick, the power controller's
poll, the executor's `Completion`), on in-memory stores, decides the same.

The recording holds a power budget the rack's draw is over (the controller's requests),
a drift that needs approval (a person approves it; the next tick decides it again), a
lost GPU that is reset and validated by a probe, and a silent agent.

`gpuops replay` under a site's settings file (a wider breaker) decides as the live engine
under the same settings, cooldowns and breaker trip included, and not as under the defaults.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
from pathlib import Path
from typing import Any

import yaml
from gpuops import subjects
from gpuops.act.completion import Completion
from gpuops.bus.buckets import Buckets
from gpuops.bus.publish import MemoryPublisher
from gpuops.catalog import load_catalog
from gpuops.clock import ManualClock
from gpuops.inventory.hosts import Inventory, load_inventory
from gpuops.match.loader import load_rules
from gpuops.models import (
    EVENT_ADAPTER,
    AuditRecord,
    Decision,
    Event,
    Intent,
    ProbeEvent,
    RunOutcome,
    RunStatus,
)
from gpuops.ops.power import do_power
from gpuops.power.config import PowerSettings
from gpuops.settings import Settings
from gpuops.sim.fleet import SimFleet, envelope
from gpuops.spine.build import Engine, build_engine
from gpuops.spine.report import Report
from gpuops.spine.shadow import Shadow

from tests.conftest import ROOT
from tests.support import gpuops_argv

T0 = 1_900_000_000.0
STEP_S = 10.0
NODES = ("node-001", "node-002")
RACK = {"rack-a1": frozenset(NODES)}


def _settings() -> Settings:
    return Settings.model_validate(
        {
            "rules_dir": ROOT / "rules",
            "playbooks_dir": ROOT / "playbooks",
            "safety": {"breaker_share": 1.0, "stale_after_s": float("inf")},
            "power": {"budgets": [{"group": "rack-a1", "watts": 3000}], "interval_s": 30},
        }
    )


def _recording(tmp_path: Path) -> list[Event]:
    """What the agents of two loaded nodes send over five minutes, with faults."""
    fleet = SimFleet.create(tmp_path / "sim", nodes=2, gpus=4)
    for node in NODES:
        fleet.inject(node, "load", 0, workload="training")
    lines: list[dict[str, Any]] = []
    for step in range(30):
        t = T0 + step * STEP_S
        if step == 3:
            fleet.inject("node-002", "xid", gpu=1, at=t, xid=79)
        if step == 12:
            lines.append(
                envelope(
                    "drift",
                    "node-001",
                    t,
                    {"setting": "ecc_mode", "expected": True, "actual": False},
                )
            )
        for node in NODES:
            if step >= 20 and node == "node-001":
                continue  # node-001's agent goes silent: `agent-silent` fires from time
            sample = fleet.telemetry(node, t)
            if sample is not None:
                lines.append(sample)
            for pending in fleet.take_events(node):
                lines.append(envelope(pending["kind"], node, t, pending["data"]))
            lines.append(envelope("heartbeat", node, t, {"seq": step}))
        if step == 8:  # after the reset: the validation probe passes
            lines.append(
                envelope("probe", "node-002", t, {"gpu": 1, "ok": True, "outcome": "pass"})
            )
    return [EVENT_ADAPTER.validate_python(line) for line in lines]


class Live:
    """The live engine's parts on memory stores, driven as App's loops drive them."""

    def __init__(self, settings: Settings, inventory: Inventory | None = None) -> None:
        self.clock = ManualClock(0.0)
        self.publisher = MemoryPublisher()
        self.inventory = inventory or Inventory(Path("<live>"), frozenset(NODES), RACK, {})
        self.engine: Engine = build_engine(
            settings,
            rules=load_rules([settings.rules_dir], settings.playbooks_dir),
            inventory=self.inventory,
            catalog=load_catalog(settings.playbooks_dir),
            buckets=Buckets.memory(),
            publisher=self.publisher,
            clock=self.clock,
            signing_key=secrets.token_bytes(32),
        )
        self.completion = Completion(self.engine.recorder, self.engine.locks, self._probe)
        self.ran = 0
        self.seeded = False
        self.asked: dict[str, str] = {}  # node -> the nonce its validation request carried
        self.decisions: list[Decision] = []  # what the loops and the entry decided, in order

    async def _probe(self, node: str, nonce: str) -> None:
        self.asked[node] = nonce

    async def at(self, t: float) -> None:
        """The engine's loops at `t`, once a moment (App runs them once a tick): its tick
        and sweep, the power controller's poll, the runs."""
        if not self.seeded:  # a partition's takeover seeds its nodes' windows
            self.seeded = True
            self.engine.matcher.seed(self.inventory.hosts, t)
        elif t <= self.clock.now():
            return
        self.clock.set(t)
        self._decided(await self.engine.tick())
        await self.engine.sweep(t)
        self._decided(await self.engine.power.poll())
        await self.runs()

    async def handle(self, event: Event) -> None:
        await self.at(event.epoch)
        self._decided(await self.engine.pipeline.handle(event))
        await self.runs()

    def _decided(self, decisions: list[Decision]) -> None:
        self.decisions += [d for d in decisions if d.reason.value != "not_applicable"]

    async def runs(self) -> None:
        """The executor: each new intent started and ended (the run itself succeeds)."""
        new, self.ran = self.publisher.messages[self.ran :], len(self.publisher.messages)
        for subject, payload in new:
            if subjects.is_action(subject):
                intent = Intent.model_validate_json(payload)
                now = self.clock.now()
                await self.completion.started(intent)
                await self.completion.ended(
                    intent, RunOutcome.of(intent, RunStatus.SUCCESSFUL, now, now)
                )


def _decisions(publisher: MemoryPublisher) -> list[tuple[Any, ...]]:
    out = []
    for subject, payload in publisher.messages:
        if not subject.startswith(subjects.audit("")[: -len("_fleet")]):
            continue
        r = AuditRecord.model_validate_json(payload)
        if r.type != "decision":
            continue
        d = Decision.model_validate(r.body["decision"])
        plays = tuple(a.playbook for a in d.actions)
        out.append((r.at, d.match.node, d.match.rule, d.reason.value, plays, d.approved_by))
    return out


def _answering(event: Event, asked: dict[str, str]) -> Event:
    """A probe as the node's agent sends it: echoing the nonce of the request it was
    asked with (the recording holds what the agent sent, nonce and all)."""
    nonce = asked.get(event.node)
    if not isinstance(event, ProbeEvent) or nonce is None:
        return event
    return event.model_copy(update={"data": event.data.model_copy(update={"nonce": nonce})})


async def _states(engine: Engine) -> dict[str, str]:
    return {r.node: r.state.value for r in await engine.states.all()}


async def test_shadow_decides_and_moves_every_node_as_the_live_engine(tmp_path: Path) -> None:
    settings = _settings()
    events = _recording(tmp_path)
    live = Live(settings)
    shadow = Shadow(
        load_rules([settings.rules_dir], settings.playbooks_dir), NODES, settings, groups=RACK
    )
    live_states: list[dict[str, str]] = []
    shadow_states: list[dict[str, str]] = []
    approved = False
    for recorded in events:
        event = _answering(recorded, live.asked)
        await live.handle(event)
        await shadow.feed(event)
        live_states.append(await _states(live.engine))
        shadow_states.append(await _states(shadow.engine))
        if not approved and (held := await live.engine.approvals.all()):
            # A person approves the held drift fix on both engines at the same moment.
            [record] = held
            [twin] = await shadow.engine.approvals.all()
            assert twin.id == record.id
            now = live.clock.now()
            await live.engine.approvals.decide(record.id, True, "alice", now)
            await shadow.engine.approvals.decide(twin.id, True, "alice", now)
            approved = True
    end = events[-1].epoch + 120
    await live.at(end)
    await shadow.advance(end)
    live_states.append(await _states(live.engine))
    shadow_states.append(await _states(shadow.engine))

    mine, theirs = _decisions(live.publisher), _decisions(shadow.publisher)
    assert mine == theirs
    assert shadow_states == live_states
    rules = {(node, rule, reason) for _, node, rule, reason, _, _ in mine}
    # The recording exercised what the comparison is for:
    assert ("node-001", "power-budget", "accepted") in rules, "a power-budget decision"
    assert any(by == "alice" and reason == "accepted" for *_, reason, _, by in mine), (
        "an approved answer decided again"
    )
    assert any(rule == "validation-passed" for _, _, rule, *_ in mine), "validation"
    assert any(rule == "agent-silent" for _, _, rule, *_ in mine), "a match from silence"


async def test_a_validation_that_timed_out_live_times_out_in_a_replay(tmp_path: Path) -> None:
    """Review of issue 30: the shadow never ran what App's tick sweeps every 10 s (a node
    validating past `validation_timeout_s` goes to a person; windows of quiet keys end),
    so a probe that came 20 minutes late returned a node to service in a replay that the
    live engine had handed to a person long before."""
    settings = _settings()
    live = Live(settings)
    shadow = Shadow(
        load_rules([settings.rules_dir], settings.playbooks_dir), NODES, settings, groups=RACK
    )
    lines = []
    for step in range(0, 1300, 10):
        t = T0 + step
        lines += [envelope("heartbeat", node, t, {"seq": step}) for node in NODES]
        if step == 30:
            lines.append(envelope("xid", "node-002", t, {"gpu": 1, "xid": 79, "message": "lost"}))
    events = [EVENT_ADAPTER.validate_python(line) for line in lines]
    for event in events:
        await live.handle(event)
        await shadow.feed(event)
    late = envelope("probe", "node-002", T0 + 1300, {"gpu": None, "ok": True, "outcome": "pass"})
    probe = _answering(EVENT_ADAPTER.validate_python(late), live.asked)
    await live.handle(probe)
    await shadow.feed(probe)
    assert _decisions(shadow.publisher) == _decisions(live.publisher)
    assert await _states(shadow.engine) == await _states(live.engine)
    record = await shadow.engine.states.get("node-002")
    assert record.state.value == "needs_human" and "no validation probe answer" in record.why


async def test_a_persons_power_budget_is_in_force_in_a_replay_as_it_was_live(
    tmp_path: Path,
) -> None:
    """Review of issue 30: live, `power budget GROUP WATTS DURATION` writes its override to
    KV and is recorded as a chatops event; the shadow applied only silences from such
    events, so a replay never capped what the live engine capped."""
    settings = _settings().model_copy(update={"power": PowerSettings(interval_s=30)})
    live = Live(settings)
    shadow = Shadow(
        load_rules([settings.rules_dir], settings.playbooks_dir), NODES, settings, groups=RACK
    )
    fleet = SimFleet.create(tmp_path / "sim", nodes=2, gpus=4)
    for node in NODES:
        fleet.inject(node, "load", 0, workload="training")
    args = ["budget", "rack-a1", "2000W", "2h", "demand", "response"]
    for step in range(30):
        t = T0 + step * STEP_S
        if step == 4:  # the live command writes the override, and its event is recorded
            await live.at(t)  # the loops of this moment ran before the command came
            control = live.engine.stores.buckets.control
            await do_power(args, "cli:alice", control, settings.power, live.inventory, t)
            data = {"command": "power", "args": args, "user": "cli:alice", "platform": "cli"}
            asked = EVENT_ADAPTER.validate_python(envelope("chatops", "fleet", t, data))
            await live.handle(asked)
            await shadow.feed(asked)
        for node in NODES:
            sample = fleet.telemetry(node, t)
            if sample is not None:
                event = EVENT_ADAPTER.validate_python(sample)
                await live.handle(event)
                await shadow.feed(event)
    mine = _decisions(live.publisher)
    assert _decisions(shadow.publisher) == mine
    capped = {node for _, node, rule, reason, *_ in mine if rule == "power-budget"}
    assert capped == set(NODES), "the override capped both nodes, live and in the replay"


async def test_a_power_budget_the_replay_cannot_carry_out_is_reported() -> None:
    """Without the site's inventory, a replay knows no group `rack-a1`: the budget a
    person set live is not in force, and the report says so rather than nothing."""
    settings = _settings()
    shadow = Shadow(load_rules([settings.rules_dir], settings.playbooks_dir), NODES, settings)
    data = {"command": "power", "args": ["budget", "rack-a1", "2000W", "2h", "x"], "user": "u"}
    await shadow.feed(EVENT_ADAPTER.validate_python(envelope("chatops", "fleet", T0, data)))
    [(command, times)] = shadow.unapplied.items()
    assert command.startswith("power budget rack-a1: group 'rack-a1' is not in the inventory")
    assert times == 1


# One of four nodes may lose capacity (the defaults: two, by the breaker and the rack).
SITE = {"breaker_share": 0.25, "breaker_absolute": 1, "breaker_floor": 1}


def _site_recording(tmp_path: Path) -> tuple[Path, Path]:
    """Four nodes; lost GPUs on three of them one after another (each a reboot, counted
    by the breaker), one of them lost again within its cooldown; a power limit held low on
    the fourth (its cooldown drops every sample). The recording, and the inventory."""
    fleet = SimFleet.create(tmp_path / "sim", nodes=4, gpus=2)
    fleet.inject("node-001", "power_limit", 0, watts=400)
    lost = {3: "node-002", 6: "node-003", 9: "node-004", 14: "node-002"}
    lines: list[dict[str, Any]] = []
    for step in range(24):
        t = T0 + step * STEP_S
        if step in lost:
            fleet.inject(lost[step], "xid", gpu=1, at=t, xid=79)
        for node in sorted(fleet.nodes):
            sample = fleet.telemetry(node, t)
            if sample is not None:
                lines.append(sample)
            lines += [envelope(e["kind"], node, t, e["data"]) for e in fleet.take_events(node)]
            lines.append(envelope("heartbeat", node, t, {"seq": step}))
    path = tmp_path / "site.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path, fleet.root / "inventory"


async def _live_rows(settings: Settings, recording: list[str], inventory: Path) -> list[Any]:
    """The live engine's decisions on the recording, as `replay --json` shows decisions."""
    live = Live(settings, load_inventory(inventory))
    for line in recording:
        await live.handle(EVENT_ADAPTER.validate_json(line))
    report = Report()
    report.decided(live.decisions)
    report.breaker((await live.engine.breaker.get())[0])
    return [r for r in report.lines() if r["kind"] in ("action", "escalation", "drop", "trip")]


def test_replay_under_the_sites_settings_decides_as_the_live_engine(tmp_path: Path) -> None:
    recording, inventory = _site_recording(tmp_path)
    config = tmp_path / "gpuops.yml"
    paths = {"rules_dir": str(ROOT / "rules"), "playbooks_dir": str(ROOT / "playbooks")}
    config.write_text(yaml.safe_dump({**paths, "safety": SITE}))
    args = ["--config", str(config), "replay", str(recording), "--inventory", str(inventory)]
    replayed = subprocess.run(
        [*gpuops_argv(), *args, "--json"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert replayed.returncode == 0, replayed.stderr
    rows = [json.loads(line) for line in replayed.stdout.splitlines()]
    shown = [r for r in rows if r["kind"] in ("action", "escalation", "drop", "trip")]

    lines = recording.read_text().splitlines()
    site = Settings.model_validate({**paths, "safety": SITE})
    live = asyncio.run(_live_rows(site, lines, inventory))
    assert shown == live
    # The recording exercised what the settings change:
    defaults = asyncio.run(_live_rows(Settings.model_validate(paths), lines, inventory))
    assert defaults != live
    reboots = {r["node"] for r in live if r["kind"] == "action" and r["action"] == "reboot.yml"}
    assert reboots == {"node-002"}, "one of four within the breaker's window"
    by_default = {
        r["node"] for r in defaults if r["kind"] == "action" and r["action"] == "reboot.yml"
    }
    assert by_default == {"node-002", "node-003"}, "the default breaker lets a 4-node fleet lose 2"
    [trip] = [r for r in live if r["kind"] == "trip"]
    assert "2 nodes would lose capacity" in trip["why"] and "(limit 1)" in trip["why"]
    cooldowns = {r["node"] for r in live if r["kind"] == "drop" and r["reason"] == "cooldown"}
    assert cooldowns >= {"node-001", "node-002"}, "a held power limit, a GPU lost again"
