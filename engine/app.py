"""Wiring only: builds the pipeline from settings and runs its loops."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass, field
from typing import Any

from engine.act.driftcheck import drift_check, publish_report, render_report
from engine.act.executor import Executor
from engine.act.notify import Notifier, Webhook
from engine.bus.conn import EVENTS, TELEMETRY, Bus
from engine.bus.kvjson import get_json
from engine.clock import Clock
from engine.commands import DRY_RUN_KEY, Commands
from engine.decide.approval import APPROVED, EXECUTED, EXPIRED, PENDING, ApprovalGate, ApprovalStore
from engine.decide.attempts import AttemptCap
from engine.decide.breaker import CLOSED, BreakerStore, FleetBreaker
from engine.decide.cooldown import Cooldown
from engine.decide.equivalence import Equivalence
from engine.decide.inventory import KnownNode
from engine.decide.ladder import LadderStage
from engine.decide.lock import NodeLock
from engine.decide.silence import Silences, SilenceStore
from engine.decide.stage import Decider, Stage
from engine.decide.stale import StaleCutoff
from engine.errors import RuleError
from engine.http import HttpServer
from engine.intake.chatops import Chatops
from engine.intake.consumer import Intake
from engine.intake.scheduler import DriftScheduler
from engine.inventory import Inventory, load_inventory
from engine.match.loader import load_rules, rule_files
from engine.match.matcher import Matcher
from engine.match.rules import RuleSet
from engine.models import Intent
from engine.pipeline import Pipeline
from engine.record.audit import Auditor
from engine.record.lifecycle import Lifecycle
from engine.record.metrics import EngineCollector, registry_for
from engine.record.nodestate import NodeStates
from engine.settings import Settings

log = logging.getLogger(__name__)


def build_stages(
    settings: Settings, inventory: Inventory, bus: Bus, notifier: Notifier
) -> list[Stage]:
    """The safety stages, in the order they run."""
    s = settings.safety

    async def tripped(why: str) -> None:
        notifier.notify(
            "breaker open", f"automated quarantine stopped: {why}; reset it when understood"
        )

    return [
        KnownNode(inventory),
        StaleCutoff(s.stale_after_s),
        Silences(SilenceStore(bus.kv["control"]), inventory),
        Cooldown(bus.kv["cooldowns"]),
        Equivalence(bus.kv["history"], s.equivalence_window_s),
        NodeLock(bus.kv["locks"], s.lock_lease_s),
        LadderStage(bus.kv["history"]),
        AttemptCap(bus.kv["history"], s.attempt_cap, s.attempt_window_s),
        FleetBreaker(
            BreakerStore(bus.kv["control"]),
            len(inventory.hosts),
            share=s.breaker_share,
            absolute=s.breaker_absolute,
            window_s=s.breaker_window_s,
            on_trip=tripped,
        ),
        ApprovalGate(),
    ]


@dataclass
class App:
    """A running engine: intake, pipeline, executor, ticks, approvals and rule reloads."""

    settings: Settings
    bus: Bus
    clock: Clock
    rules: RuleSet
    inventory: Inventory
    notifier: Notifier = field(default_factory=Notifier)
    auditor: Auditor = field(init=False)
    pipeline: Pipeline = field(init=False)
    executor: Executor | None = field(init=False, default=None)
    intakes: list[Intake] = field(init=False, default_factory=list)
    stop: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    metrics: EngineCollector | None = field(init=False, default=None)
    http_port: int = field(init=False, default=0)
    _observed: float = field(init=False, default=float("-inf"))

    def __post_init__(self) -> None:
        s = self.settings
        if not self.notifier.webhooks and s.chatops.webhooks:
            self.notifier.webhooks = [Webhook(w.kind, w.url, w.channel) for w in s.chatops.webhooks]
        self.auditor = Auditor(self.bus.js)
        self.approvals = ApprovalStore(self.bus.kv["control"])
        self.breaker = BreakerStore(self.bus.kv["control"])
        self.silences = SilenceStore(self.bus.kv["control"])
        self.states = NodeStates(self.bus.kv["nodes"])
        self.lifecycle = Lifecycle(
            self.states,
            self.notifier,
            self.approvals,
            self.bus.nc,
            self.clock,
            s.safety.approval_timeout_s,
        )
        matcher = Matcher(self.rules)
        matcher.seed(self.inventory.hosts, self.clock.now())
        decider = Decider(
            build_stages(s, self.inventory, self.bus, self.notifier), self.clock, s.dry_run
        )
        self.pipeline = Pipeline(
            matcher, decider, self.auditor, self.bus.js, self.clock, self.inventory, self.lifecycle
        )
        if s.role in ("all", "engine"):
            self.intakes = [
                Intake(
                    self.bus.js,
                    self.clock,
                    stream=EVENTS,
                    subject="gpuops.events.>",
                    durable="gpuops-engine",
                    handler=self.pipeline.handle,
                    batch=64,
                ),
                Intake(
                    self.bus.js,
                    self.clock,
                    stream=TELEMETRY,
                    subject="gpuops.telemetry.>",
                    durable="gpuops-engine-telemetry",
                    handler=self.pipeline.handle,
                    batch=s.intake_batch,
                    ack_all=True,
                ),
            ]
        if s.role in ("all", "executor"):
            self.executor = Executor(
                self.bus,
                self.auditor,
                self.clock,
                playbooks_dir=s.playbooks_dir,
                inventory=s.inventory,
                cache_dir=s.state_dir / "playbook-refs",
                parallel=s.max_parallel_runs,
                max_timeout_s=s.run_timeout_s,
                lifecycle=self.lifecycle,
            )

    async def run(self) -> None:
        """Run every loop until `stop` is set (SIGINT/SIGTERM set it too)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stop.set)
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self.reload()))
        loops = [i.run(self.stop) for i in self.intakes]
        if self.intakes:
            loops += [self._tick(), self._watch_rules()]
        if self.executor is not None:
            loops.append(self.executor.run(self.stop))
        server = await self._start_http() if self.settings.http else None
        if self.settings.drift.schedules and self.intakes:
            loops.append(self.scheduler().run(self.stop))
        log.info(
            "engine running: %d rules, %d hosts, role=%s, dry_run=%s",
            len(self.rules.rules),
            len(self.inventory.hosts),
            self.settings.role,
            self.settings.dry_run,
        )
        try:
            await asyncio.gather(*loops)
        finally:
            if server is not None:
                await server.stop()
            await self.notifier.drain()

    def commands(self) -> Commands:
        """The command set people use, bound to this engine (drift checks run here)."""
        return Commands(
            self.bus, self.clock, self.inventory, self.settings.chatops, self.run_drift_check
        )

    def scheduler(self) -> DriftScheduler:
        """The drift-check schedules of the settings, run by this engine."""

        async def record(summary: str, body: dict[str, object]) -> None:
            await self.auditor.note(self.clock.now(), "", summary, body)

        async def check(group: str) -> None:
            await self.run_drift_check(group)

        return DriftScheduler(
            self.settings.drift.schedules,
            self.bus.kv["control"],
            self.clock,
            check,
            record,
            self.settings.drift.grace_s,
        )

    async def _start_http(self) -> HttpServer:
        self.metrics = EngineCollector(self)
        registry = registry_for(self.metrics)
        chatops = Chatops(
            self.commands(), self.settings.chatops, self.auditor, self.clock, registry
        )
        server = HttpServer(registry, self._health, mounts=[chatops.mount])
        self.http_port = await server.start(self.settings.http or "127.0.0.1:0")
        self.metrics.chatops = chatops
        return server

    def _health(self) -> tuple[bool, dict[str, Any]]:
        """For /healthz: degraded while NATS is away."""
        if self.bus.nc.is_connected:
            return True, {}
        return False, {"why": "NATS is not connected"}

    async def run_drift_check(self, group: str) -> str:
        """One drift check now over `group`; its events go on the bus for the drift rules."""
        report = await drift_check(
            self.inventory,
            self.settings.playbooks_dir,
            self.clock,
            group=group,
            batch_size=self.settings.drift.batch_size,
            forks=self.settings.drift.forks,
        )
        await publish_report(self.bus.js, report)
        await self.auditor.note(
            self.clock.now(), "", report.line(), {"drift_check": report.summary()}
        )
        return render_report(report)

    async def _tick(self) -> None:
        while not self.stop.is_set():
            await self.pipeline.tick()
            await self.settle_approvals()
            switch, _ = await get_json(self.bus.kv["control"], DRY_RUN_KEY)
            self.pipeline.decider.dry_run = self.settings.dry_run or bool(switch)
            await self._observe()
            self.pipeline.matcher.sweep()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.settings.tick_s)

    async def _observe(self) -> None:
        """Consumer lag and breaker state for /metrics (every few seconds, not per event)."""
        if self.metrics is None or self.clock.now() - self._observed < 5.0:
            return
        self._observed = self.clock.now()
        for intake in self.intakes:
            with contextlib.suppress(Exception):
                info = await self.bus.js.consumer_info(intake.stream, intake.durable)
                self.metrics.consumer_pending[intake.durable] = info.num_pending
        breaker, _ = await self.breaker.get()
        self.metrics.breaker_open = 1.0 if breaker["state"] == "open" else 0.0

    async def settle_approvals(self) -> None:
        """Write the intents of approved actions; expire the ones nobody answered (a deny)."""
        now = self.clock.now()
        for record, rev in await self.approvals.all():
            if record["status"] == APPROVED and await self.approvals.mark(record, EXECUTED, rev):
                for raw in record["intents"]:
                    await self.pipeline.write_intent(Intent.model_validate(raw))
                if record.get("closes_breaker"):
                    await self.breaker.set_state(
                        CLOSED, f"half-open action approved by {record.get('by')}", now
                    )
                await self.auditor.note(
                    self.clock.now(),
                    record["node"],
                    f"approval {record['id']} by {record.get('by')}: running "
                    f"{len(record['intents'])} action(s)",
                    record,
                )
            elif (
                record["status"] == PENDING
                and now >= record["expires"]
                and await self.approvals.mark(record, EXPIRED, rev)
            ):
                self.notifier.notify(
                    "approval expired", f"{record['id']}: {record['summary']} (denied)"
                )
                await self.auditor.note(
                    self.clock.now(),
                    record["node"],
                    f"approval {record['id']} expired: denied",
                    record,
                )

    async def _watch_rules(self) -> None:
        """Reload when a rule file changes (polling: works on every filesystem)."""
        seen = _mtimes(self.settings)
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), 2.0)
            now = _mtimes(self.settings)
            if now != seen:
                seen = now
                await self.reload()

    async def reload(self) -> bool:
        """Load and check the rules; on any error keep the last good set and say why."""
        try:
            rules = load_rules([self.settings.rules_dir], self.settings.playbooks_dir)
        except RuleError as exc:
            log.error("rules not reloaded, keeping the last good set:\n%s", exc)
            await self.auditor.note(
                self.clock.now(),
                "",
                "rule reload rejected; last good rules kept",
                {"errors": str(exc)},
            )
            return False
        self.rules = rules
        self.pipeline.matcher.replace(rules)
        log.info("rules reloaded: %d rules", len(rules.rules))
        await self.auditor.note(
            self.clock.now(),
            "",
            f"rules reloaded: {len(rules.rules)} rules",
            {"rules": [r.name for r in rules.rules]},
        )
        return True


def _mtimes(settings: Settings) -> dict[str, float]:
    try:
        return {str(p): p.stat().st_mtime for p in rule_files([settings.rules_dir])}
    except (OSError, RuleError):
        return {}


def load_world(settings: Settings) -> tuple[RuleSet, Inventory]:
    """Rules and inventory, checked before anything connects."""
    return load_rules([settings.rules_dir], settings.playbooks_dir), load_inventory(
        settings.inventory
    )
