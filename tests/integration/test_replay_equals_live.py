"""`gpuops replay` decides exactly like the live engine: one recorded stream, two engines.

The live engine runs on a real nats-server with its executor and real ansible-runner
against the simulated fleet, on a clock the test moves: each step publishes what the
fleet's agents would send at that time, waits until the engine has decided it and every
run has ended, then moves on. Everything published is also written to a recording,
which `replay` then feeds through the shadow engine (in-memory stores, the same stages).
The stream holds every fault family, a silence given by a person, a ladder that climbs
a rung, validation after remediation, and a storm over three racks that spends two
racks' budgets (two nodes of a rack at a time) and trips the fleet breaker.
"""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from gpuops import subjects
from gpuops.agent.probe import requested_nonce
from gpuops.bus.conn import ACTIONS, EVENTS, Bus, connect
from gpuops.bus.identity import ENGINE, KeyRing
from gpuops.bus.server import EmbeddedNats
from gpuops.clock import ManualClock
from gpuops.match.loader import load_rules
from gpuops.models import subject_for
from gpuops.ops.commands import Caller
from gpuops.record.audit import read_audit
from gpuops.scale.lag import drained
from gpuops.settings import NatsSettings, Settings
from gpuops.sim.fleet import SimFleet, envelope
from gpuops.spine.app import App
from gpuops.spine.replay import replay

from tests.conftest import ROOT, engine_settings, running_engine, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEP_S = 20.0
T0 = 1_900_000_000.0


class Recorder:
    """Publishes what the agents and a person send, and keeps a copy of each event."""

    def __init__(self, bus: Bus, fleet: SimFleet, path: Path) -> None:
        self.bus, self.fleet, self.path = bus, fleet, path
        self.lines: list[str] = []
        self.keys: KeyRing | None = None  # the live engine's: each node signs its own
        self.asked: dict[str, str] = {}  # node -> the nonce of a validation request

    async def listen(self, keys: KeyRing) -> None:
        """Sign as the nodes, and hear the executor's validation requests, as agents do."""
        self.keys = keys

        async def asked(msg: Any) -> None:
            nonce = requested_nonce(msg.data)
            if nonce is not None:
                self.asked[msg.subject.split(".")[2]] = nonce

        await self.bus.nc.subscribe(subjects.PROBE_REQUESTS, cb=asked)

    async def send(self, event: dict[str, Any], as_engine: bool = False) -> None:
        data = json.dumps(event)
        self.lines.append(data)
        subject = subject_for(event["kind"], event["node"])
        assert self.keys is not None
        signer = self.keys.signer(ENGINE) if as_engine else self.keys.node(event["node"])
        headers = signer.headers(data.encode(), {"Nats-Msg-Id": event["id"]})
        await self.bus.js.publish(subject, data.encode(), headers=headers)

    async def step(self, t: float, probe: bool) -> None:
        """One telemetry interval: samples, then heartbeats, pending XIDs and probes."""
        for node in self.fleet.nodes:
            sample = self.fleet.telemetry(node, t)
            if sample is not None:
                await self.send(sample)
        for node in self.fleet.nodes:
            if self.fleet.state(node)["agent_silent"]:
                continue
            for pending in self.fleet.take_events(node):
                await self.send(envelope(pending["kind"], node, t, pending["data"]))
            await self.send(envelope("heartbeat", node, t, {"seq": int(t)}))
            if node in self.asked:  # the validation's probe, answering its request
                data = self.fleet.probe(node) | {"nonce": self.asked.pop(node)}
                await self.send(envelope("probe", node, t, data))
            elif probe:
                await self.send(envelope("probe", node, t, self.fleet.probe(node)))

    def save(self) -> Path:
        self.path.write_text("\n".join(self.lines) + "\n")
        return self.path


async def _settled(bus: Bus) -> bool:
    """Every event decided and every run ended and recorded."""
    for telemetry in (False, True):
        if not await drained(bus.js, telemetry, 1):
            return False
    return (await bus.js.stream_info(ACTIONS)).state.messages == 0


def _by_node(decisions: list[tuple[str, str, str, str]]) -> dict[str, list[tuple[str, ...]]]:
    out: dict[str, list[tuple[str, ...]]] = defaultdict(list)
    for node, rule, key, reason in decisions:
        out[node].append((rule, key, reason))
    return dict(out)


def _audit_decisions(records: list[Any]) -> list[tuple[str, str, str, str]]:
    rows = []
    for r in records:
        d = r["decision"]
        rows.append((d["match"]["node"], d["match"]["rule"], d["match"]["key"], d["reason"]))
    return rows


def _rules(tmp: Path) -> Path:
    """The shipped rules, with the lost-GPU cooldown shortened so the ladder climbs here."""
    rules = tmp / "rules"
    shutil.copytree(ROOT / "rules", rules)
    zombie = rules / "zombie.yml"
    text = zombie.read_text().replace("cooldown: 1h\n    ladder:", "cooldown: 5m\n    ladder:")
    zombie.write_text(text)
    assert "cooldown: 5m" in zombie.read_text()
    return rules


async def _live(
    tmp_path: Path, bus: Bus, fleet: SimFleet, settings: Settings, rec: Recorder
) -> tuple[App, ManualClock]:
    clock = ManualClock(T0)
    async with running_engine(settings, bus, clock) as app:
        await rec.listen(app.keys)
        commands = app.commands()
        for i in range(int(1500 / STEP_S)):
            t = T0 + i * STEP_S
            clock.set(t)
            _faults(fleet, t)
            if t == T0 + 200:  # a person silences node-008 from chat, with a reason
                await commands.run(
                    "silence node:node-008 30m firmware work", Caller.of("cli", "alice")
                )
                rec.lines.append(await _last_chatops(bus))
            if t == T0 + 220:
                fleet.inject("node-008", "xid", 0, xid=48)
            if t == T0 + 140:  # what a drift check reports for a drifted setting
                fleet.inject("node-009", "drift", 1, setting="persistence_mode", value=False)
                drift = {"setting": "persistence_mode", "expected": True, "actual": False, "gpu": 1}
                await rec.send(envelope("drift", "node-009", t, drift), as_engine=True)
            await rec.step(t, probe=i % 3 == 0)
            await wait_for(lambda: _settled(bus), 120)
            await app.engine.pipeline.tick()
        return app, clock


def _faults(fleet: SimFleet, t: float) -> None:
    """Every family, one node each; the lost GPU twice (the ladder); then a storm."""
    at = t - T0
    if at == 40:
        fleet.inject("node-002", "overheat", 1)
        fleet.inject("node-003", "power_limit", 0, watts=400)
        fleet.inject("node-007", "silent")
    if at == 100:
        fleet.inject("node-004", "xid", 1, xid=79)
        fleet.inject("node-005", "zombie", 0)
        fleet.inject("node-006", "xid", 1, xid=48)
    if at in (500, 1000):
        fleet.inject("node-004", "xid", 1, xid=79)  # again within the ladder's day: climb
    if at == 700:
        for n in range(10, 18):  # a cooling failure in a row: 40% of the fleet, 3 racks
            fleet.inject(f"node-{n:03d}", "overheat", 0)


async def _last_chatops(bus: Bus) -> str:
    info = await bus.js.stream_info(EVENTS)
    for seq in range(info.state.last_seq, 0, -1):
        msg = await bus.js.get_msg(EVENTS, seq)
        if msg.subject.split(".")[3:4] == ["chatops"]:  # gpuops.events.<p>.chatops.<node>
            return msg.data.decode()
    raise AssertionError("the silence command published no chatops event")


async def test_replay_of_the_recorded_stream_decides_like_the_live_engine(
    tmp_path: Path, bus: Bus, nats_server: EmbeddedNats
) -> None:
    fleet = SimFleet.create(tmp_path / "sim", nodes=20, gpus=2)
    # One partition: the live engine decides in the order the events were stored, as the
    # replay does. With several, partitions decide side by side, and which 4 of the 8
    # storm nodes the breaker and the racks' budgets let through depends on which
    # partition got there first.
    bus = await connect(nats_server.url, NatsSettings(partitions=1))
    settings = engine_settings(
        tmp_path,
        fleet,
        nats_server.url,
        nats={"url": nats_server.url, "partitions": 1},
        rules_dir=_rules(tmp_path),
        safety={"breaker_share": 0.2},  # 4 of 20 nodes may lose capacity in 10 minutes
        tick_s=3600.0,  # the test ticks the engine itself, after each step
    )
    rec = Recorder(bus, fleet, tmp_path / "recording.jsonl")
    await _live(tmp_path, bus, fleet, settings, rec)
    live = _audit_decisions([r.body async for r in read_audit(bus.js) if r.type == "decision"])

    rules = load_rules([settings.rules_dir], settings.playbooks_dir)
    shadow, report = await replay(rec.save(), rules, fleet.root / "inventory", settings)
    assert report.refusals() == 0, report.refused
    audit = [json.loads(p) for s, p in shadow.publisher.messages if s.startswith("gpuops.audit.")]
    replayed = _audit_decisions([r["body"] for r in audit if r["type"] == "decision"])

    reasons = {r for *_, r in live}
    for wanted in (
        *("accepted", "silenced", "breaker_open", "domain_budget"),
        *("needs_human", "no_action", "cooldown"),
    ):
        assert wanted in reasons, f"the stream exercises {wanted}: {sorted(reasons)}"
    rules_seen = {rule for _, rule, _, _ in live}
    families = ("gpu-overheat", "power-limit-below-policy", "xid-79-gpu-lost", "probe-failed")
    for wanted_rule in (*families, "agent-silent", "drift-safe-fix", "validation-passed"):
        assert wanted_rule in rules_seen, sorted(rules_seen)
    assert _by_node(replayed) == _by_node(live)
    await bus.close()
