"""A running engine: the built pipeline, its loops, supervised, and its HTTP endpoint.

Every loop is supervised: an error (NATS gone for longer than a request's timeout, a
bug in a handler) is logged, counted, shown in `/healthz`, and the loop starts again
after a backoff, so the engine survives an outage of any length and resumes where its
durable consumers left off.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.msg import Msg

from gpuops import subjects
from gpuops.act.driftcheck import drift_check, publish_report, render_report
from gpuops.act.evidence import Evidence
from gpuops.act.executor import Executor
from gpuops.act.runenv import RunEnv
from gpuops.bus.buckets import Buckets
from gpuops.bus.client import away
from gpuops.bus.conn import EVENTS, TELEMETRY, Bus
from gpuops.bus.embedded import enrol
from gpuops.bus.identity import ENGINE, EXECUTOR, KeyRing, Verifier
from gpuops.bus.publish import JetStreamPublisher
from gpuops.catalog import Catalog, load_catalog
from gpuops.clock import Clock
from gpuops.console import Console, Latest
from gpuops.console.latest import SIGNALS
from gpuops.decide.breaker import BreakerState
from gpuops.diagnose.topology import Manifests
from gpuops.errors import ConfigError, EngineError
from gpuops.http import HttpServer
from gpuops.intake.alertmanager import AlertmanagerReceiver
from gpuops.intake.compact import FactsBook
from gpuops.intake.consumer import Intake, Priority
from gpuops.intake.scheduler import DriftScheduler
from gpuops.inventory.hosts import Inventory, load_inventory
from gpuops.inventory.targets import Targets
from gpuops.match.builtin import with_builtins
from gpuops.match.loader import load_rules, rule_files
from gpuops.match.rules import RuleSet
from gpuops.ops.chatops import Chatops
from gpuops.ops.cmdwire import CommandReply
from gpuops.ops.commands import Commands
from gpuops.ops.heartbeat import EVERY_S as HEARTBEAT_EVERY_S
from gpuops.ops.heartbeat import Heartbeats, this_process
from gpuops.record.audit import Auditor
from gpuops.record.density import render as render_density
from gpuops.record.nodestate import node_counts
from gpuops.record.notify import Notifier, Webhook
from gpuops.record.unreadable import SHOWN
from gpuops.scale.leases import default_replica_id
from gpuops.scale.replica import Partitions, ReplicaLock, filters
from gpuops.settings import Settings, secret_values
from gpuops.signing import load_key
from gpuops.spine.build import Engine, build_engine
from gpuops.spine.pipeline import Pipeline
from gpuops.spine.statemodels import model_of

log = logging.getLogger(__name__)

BACKOFF_MAX_S = 10.0
# A loop that failed within this long makes /healthz say degraded; one that has run
# since without failing is well again (loops restart; they do not return).
RECENT_FAILURE_S = 15.0
# A loop that failed only because NATS is away (gpuops.bus.client.away) tries again after
# this pause, with no backoff: /healthz already says NATS is not connected, and a loop
# backing off for seconds after the reconnect would leave the engine idle (and degraded).
AWAY_PAUSE_S = 0.5
OBSERVE_EVERY_S = 5.0


def signing_key_path(settings: Settings) -> Path:
    """Where the intent signing key is (settings, else under the state dir)."""
    return settings.signing_key or settings.state_dir / "keys" / "intent.key"


def identity_key_path(settings: Settings) -> Path:
    """Where the identity key every publisher's key comes from is (gpuops.bus.identity)."""
    return settings.identity.key_file or settings.state_dir / "keys" / "identity.key"


def identity_key(settings: Settings) -> bytes:
    """The identity key, made on first use (0600)."""
    return load_key(identity_key_path(settings), "identity key")


def writable_state_dir(settings: Settings) -> Path:
    """The state dir, made if missing and proved writable; a ConfigError in one line
    naming it otherwise (read-only, a file in the way, not ours), before anything else
    would fail on it halfway through starting."""
    path = settings.state_dir
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".writable-"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"state dir {path} is not writable ({exc.strerror or exc}): give gpuops a "
            "writable one (--state-dir, GPUOPS_STATE_DIR)"
        ) from exc
    return path


def enrol_inventory(settings: Settings, inventory: Inventory) -> None:
    """Every inventory node's NATS user and publisher key on the state dir, before the
    embedded server starts (its users are read then): agents started here find them."""
    enrol(settings.state_dir, sorted(inventory.hosts), identity_key(settings))


@dataclass
class App:
    """The engine's loops around one built pipeline."""

    settings: Settings
    bus: Bus
    clock: Clock
    rules: RuleSet
    inventory: Inventory
    notifier: Notifier = field(init=False)
    engine: Engine = field(init=False)
    catalog: Catalog = field(init=False)
    executor: Executor | None = field(init=False, default=None)
    partitions: Partitions | None = field(init=False, default=None)
    stop: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    http_port: int = field(init=False, default=0)
    watching: asyncio.Event = field(init=False, default_factory=asyncio.Event)
    # loop -> (why, monotonic time): a loop that failed recently, for /healthz.
    failing: dict[str, tuple[str, float]] = field(init=False, default_factory=dict)
    started: float = field(init=False, default=0.0)
    latest: Latest = field(init=False)
    priority: Priority = field(init=False, default_factory=Priority)
    keys: KeyRing = field(init=False)
    verifier: Verifier = field(init=False)
    facts: FactsBook = field(init=False)

    def __post_init__(self) -> None:
        s = self.settings
        self.keys = KeyRing(identity_key(s))
        self.verifier = Verifier(self.keys, required=s.identity.required)
        # Telemetry v2's static facts, of the inventory's nodes, shared by the intakes.
        self.facts = FactsBook(self.bus.buckets.facts, known=self.inventory.__contains__)
        self.started = self.clock.now()
        self.notifier = Notifier([Webhook(w.kind, w.url, w.channel) for w in s.chatops.webhooks])
        self.catalog = load_catalog(s.playbooks_dir)
        # A manifest that does not read stops the engine at start, naming the file.
        self.manifests = Manifests.load(s.drift.topology_dir)
        key = load_key(signing_key_path(s))
        self.latest = Latest(self.inventory)
        self.engine = build_engine(
            s,
            rules=self.rules,
            inventory=self.inventory,
            catalog=self.catalog,
            buckets=self.bus.buckets,
            # What the engine publishes itself (alerts, drift reports, commands) is its own.
            publisher=JetStreamPublisher(self.bus.js, self.keys.signer(ENGINE)),
            clock=self.clock,
            signing_key=key,
            notifier=self.notifier,
            observers=(self.latest.observe,),  # the console's heatmap
            sharing=self,  # which nodes are this replica's: its partitions (below)
        )
        if s.role in ("all", "engine"):
            self.partitions = Partitions(
                self.bus.js,
                self.lane.leases,  # renewals on their own connection
                self.replica_id,
                s.nats.partitions,
                s.nats.lease_s,
                self.clock,
                self.engine.matcher,
                self.inventory.hosts,
                self._intake,
                self.engine.metrics,
                self.facts,
            )
        if s.role in ("all", "executor"):
            self.executor = Executor(
                self.bus,
                self.engine.recorder,
                self.clock,
                claims=self.engine.buckets.claims,
                locks=self.engine.locks,
                catalog=self.catalog,
                inventory=self.inventory,
                signing_key=key,
                metrics=self.engine.metrics,
                playbooks_dir=s.playbooks_dir,
                cache_dir=s.state_dir / "playbook-refs",
                parallel=s.max_parallel_runs,
                max_timeout_s=s.run_timeout_s,
                claim_stale_s=s.run_claim_stale_s,
                max_age_s=s.safety.lock_lease_s,
                runs=s.executor,
                evidence=Evidence(
                    s.state_dir / "runs",
                    s.executor.evidence_max_age_s,
                    s.executor.evidence_max_bytes,
                    secrets=secret_values(s),
                ),
                run_env=RunEnv.of(s),
                signer=self.keys.signer(EXECUTOR),
            )

    def owns(self, node: str) -> bool:
        """Whether this replica decides for the node now (its partition's lease; a process
        that runs no engine loops has no partitions to ask)."""
        return self.partitions is None or self.partitions.owns(node)

    def shared_with_others(self, nodes: frozenset[str]) -> bool:
        """Whether another replica owns the partition of some of these nodes."""
        return self.partitions is not None and self.partitions.shared_with_others(nodes)

    @property
    def lane(self) -> Buckets:
        """The buckets on the bus's lane (its own connection for leases and heartbeats),
        or the bus's own where it has none."""
        return (self.bus.lane or self.bus).buckets

    @property
    def replica_id(self) -> str:
        """This engine's name among the replicas."""
        return self.settings.replica_id or default_replica_id(str(self.settings.state_dir))

    def _intake(self, stream: str, telemetry: bool, partition: int, name: str) -> Intake:
        """The consumer of one partition of a stream (made by the partition's takeover)."""
        return Intake(
            self.bus.js,
            self.clock,
            stream=stream,
            subject=filters(telemetry, partition),
            durable=name,
            create=False,
            handler=self.engine.pipeline.handle,
            batch=self.settings.intake_batch if telemetry else 16,
            linger_s=self.settings.intake_linger_ms / 1000 if telemetry else 0.0,
            ack_all=telemetry,
            max_future_s=self.settings.max_future_skew_s,
            on_dead=lambda reason: self.engine.metrics.dead_letters.labels(reason).inc(),
            on_batch=self._batch_seen(stream),
            priority=self.priority,  # health events first: telemetry pauses for them
            urgent=not telemetry,
            identity=self.verifier,
            facts=self.facts if telemetry else None,  # one intake per node saves its facts
        )

    def _batch_seen(self, stream: str) -> Callable[[int, float], None]:
        """An intake's report of each pull, into the stream's metrics."""
        size = self.engine.metrics.intake_batch.labels(stream)
        busy = self.engine.metrics.intake_busy.labels(stream)

        def seen(messages: int, busy_s: float) -> None:
            size.observe(messages)
            busy.inc(max(0.0, busy_s))

        return seen

    @property
    def pipeline(self) -> Pipeline:
        """The engine's pipeline."""
        return self.engine.pipeline

    @property
    def auditor(self) -> Auditor:
        """The audit trail's writer."""
        return self.engine.auditor

    async def run(self) -> None:
        """Run every loop until `stop` is set (SIGINT/SIGTERM set it too)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stop.set)
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self.reload()))
        loops: dict[str, Callable[[], Awaitable[None]]] = {}
        if self.partitions is not None:
            loops["partitions"] = self._partitions
        loops["heartbeat"] = self._heartbeat
        loops["notes"] = self._notes  # every role tells people (an executor: failed runs)
        if self.partitions is not None:
            loops["tick"], loops["rules"] = self._tick, self._watch_rules
            loops["commands"] = self._answer_commands
            loops["power"] = lambda: self.engine.power.run(self.stop)
            if self.settings.drift.schedules:
                loops["drift"] = lambda: self.scheduler().run(self.stop)
        if self.executor is not None:
            loops["executor"] = lambda: self.executor.run(self.stop)  # type: ignore[union-attr]
        with contextlib.ExitStack() as held:
            if self.partitions is not None:
                held.enter_context(ReplicaLock(self.settings.state_dir, self.replica_id))
            await self._run_loops(loops)

    async def _partitions(self) -> None:
        """Take partitions only once the dry-run switch people left is read: a restart of a
        dry-run fleet must not act on the events it finds waiting."""
        assert self.partitions is not None
        await self.engine.stores.dry_run.read()
        await self.partitions.run(self.stop)

    async def _run_loops(self, loops: dict[str, Callable[[], Awaitable[None]]]) -> None:
        server = await self._start_http() if self.settings.http else None
        log.info(
            "engine running: %d rules, %d hosts, role=%s, dry_run=%s, replica %s of %d partitions",
            len(self.rules.rules),
            len(self.inventory.hosts),
            self.settings.role,
            self.settings.dry_run,
            self.replica_id,
            self.settings.nats.partitions,
        )
        try:
            await asyncio.gather(*(self._supervised(n, f) for n, f in loops.items()))
        finally:
            if server is not None:
                await server.stop()
            self.engine.recorder.flush(force=True)  # what was grouped still goes out
            await self.notifier.drain()

    async def _heartbeat(self) -> None:
        """Say in KV that this engine runs (for `status`), every few seconds until stopped;
        a last beat says it stopped."""
        beats = Heartbeats(self.lane.control)
        beat = this_process(
            self.settings.role,
            self.started,
            len(self.rules.rules),
            len(self.inventory.hosts),
            dry_run=self.settings.dry_run,
            inventory=str(self.settings.inventory.resolve()),
        )
        unreadable = self.engine.stores.unreadable
        while not self.stop.is_set():
            # What this engine found unreadable, looked at again: a record repaired
            # through another replica, or written anew, drops out.
            await unreadable.recheck(self.engine.buckets.by_name(), model_of)
            beat = beat.model_copy(
                update={
                    "at": self.clock.now(),
                    "wall": time.time(),  # what `status` ages it by (the clock may be scaled)
                    "rules": len(self.rules.rules),
                    "unreadable": tuple(u.line() for u in unreadable.entries()[:SHOWN]),
                }
            )
            await beats.beat(beat)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), HEARTBEAT_EVERY_S)
        with contextlib.suppress(Exception):  # NATS may be gone already; the beat ages
            await beats.beat(beat.model_copy(update={"stopped": self.clock.now()}))

    async def _answer_commands(self) -> None:
        """Answer operators' commands (`gpuops approve` and the like) until stopped.

        A core-NATS subscription: nats-py subscribes again after a reconnect, and the
        queue group lets one of several engines answer each request.
        """
        commands = self.commands()

        async def answer(msg: Msg) -> None:
            try:
                reply = await commands.answer(msg.subject, msg.data)
            except Exception as exc:  # a bug must not leave the operator waiting
                log.exception("command on %s failed", msg.subject)
                reply = CommandReply(ok=False, kind="failed", text=f"engine error: {exc}").dump()
            await msg.respond(reply)

        sub = await self.bus.nc.subscribe(subjects.COMMANDS, queue="gpuops-engine", cb=answer)
        try:
            await self.stop.wait()
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _supervised(self, name: str, body: Callable[[], Awaitable[None]]) -> None:
        """Run a loop until stop; on an error, say so and start it again after a backoff."""
        delay, told = 0.5, 0.0
        while not self.stop.is_set():
            began = time.monotonic()
            try:
                await body()
                self.failing.pop(name, None)
                return
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any error: the loop must come back, not the process die
                if away(exc):
                    self.engine.metrics.loop_restarts.labels(name).inc()
                    if began - told > BACKOFF_MAX_S:  # once per outage, not every pause
                        log.info("loop %s: NATS away (%s); trying again", name, exc)
                    told = time.monotonic()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.stop.wait(), AWAY_PAUSE_S)
                    continue
                why = f"{type(exc).__name__}: {exc}"[:300]
                self.failing[name] = (why, time.monotonic())
                self.engine.metrics.loop_restarts.labels(name).inc()
                log.warning("loop %s failed (%s); restarting in %.1fs", name, why, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), delay)
            delay = min(delay * 2, BACKOFF_MAX_S)

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Ready when NATS is connected and no loop failed lately; else why not."""
        why: dict[str, Any] = {}
        if not self.bus.connected:
            why["nats"] = "not connected; reconnecting"
        recent = time.monotonic() - RECENT_FAILURE_S
        why.update({f"loop {k}": w for k, (w, at) in self.failing.items() if at > recent})
        unowned = self.partitions.unowned() if self.partitions is not None else []
        if unowned:  # their nodes' events wait in the stream, decided by nobody
            why["partitions"] = f"no replica holds partition(s) {unowned}"
        server = self.bus.server
        detail = {"nats_restarts": server.restarts} if server is not None else {}
        return not why, {**why, **detail} if why else detail

    def commands(self) -> Commands:
        """The command set people use, bound to this engine (drift checks run here)."""
        return Commands(
            self.bus,
            self.clock,
            self.inventory,
            self.settings.chatops,
            self.engine.stores,
            self.run_drift_check,
            self.settings.power,
            density=self.density_report,
            model_of=model_of,
        )

    def density_report(self, threshold: float) -> str:
        """The GPUs under `threshold`% p95 utilisation over the day, with a layout each
        (a host in the inventory's development pool, `pool: development`, is time-sliced)."""
        tracker = self.engine.pipeline.density
        hostvars = self.inventory.hostvars

        def development(node: str) -> bool:
            return hostvars.get(node, {}).get("pool") == "development"

        return render_density(
            tracker.underused(threshold, development), threshold, len(tracker.gpus)
        )

    @property
    def http_address(self) -> str:
        """Where the HTTP server listens (`host:port`); the console's login rule reads it."""
        return self.settings.http or "127.0.0.1:0"

    def console(self) -> Console:
        """The web console over this engine's stores, commands and newest samples."""
        return Console(
            self.commands(),
            self.settings.console,
            self.latest,
            Evidence(self.settings.state_dir / "runs"),
            bind=self.http_address,
            clock=self.clock,
            registry=self.engine.metrics.registry,
            budgets=self.power_budgets,
            rules=lambda: self.rules,
        )

    async def power_budgets(self) -> list[dict[str, Any]]:
        """The budgets that hold now, where each comes from, and the watts its GPUs draw
        by their newest samples (the console's panel)."""
        power = SIGNALS.index("power_w")
        rows = []
        for budget in await self.engine.power.budgets():
            used = sum(
                value
                for node in budget.nodes
                for cell in self.latest.gpus(node).values()
                if (value := cell.values[power]) is not None
            )
            rows.append(
                {
                    "name": budget.group,
                    "limit_w": round(budget.watts),
                    "used_w": round(used),
                    "source": budget.source,
                }
            )
        return rows

    def scheduler(self) -> DriftScheduler:
        """The drift-check schedules of the settings, run by this engine."""

        async def record(summary: str, body: dict[str, object]) -> None:
            await self.engine.auditor.note(self.clock.now(), "", summary, body)

        async def check(group: str) -> None:
            await self.run_drift_check(group)

        return DriftScheduler(
            self.settings.drift.schedules,
            self.engine.buckets.control,
            self.clock,
            check,
            record,
            self.settings.drift.grace_s,
        )

    async def _start_http(self) -> HttpServer:
        registry = self.engine.metrics.registry
        chatops = Chatops(
            self.commands(),
            self.settings.chatops,
            self.engine.auditor,
            self.clock,
            registry,
            self.engine.buckets.replay,
        )
        mounts = [chatops.mount]
        if self.partitions is not None:  # what the receiver publishes is this engine's to decide
            mounts.append(self.alertmanager().mount)
        if self.settings.console.enabled:
            mounts.append(self.console().mount)
        server = HttpServer(registry, self.health, mounts, self.settings.http_limits)
        self.http_port = await server.start(self.http_address)
        return server

    def alertmanager(self) -> AlertmanagerReceiver:
        """The Alertmanager webhook receiver, publishing on this engine's bus."""
        return AlertmanagerReceiver(
            self.settings.sources.alertmanager,
            self.engine.stores.auditor.publisher,  # the engine's: signed as its own
            self.engine.buckets.history,
            self.clock,
            self.engine.metrics.registry,
            Targets(self.inventory, self.settings.sources.alertmanager.claim_label),
            on_dead=lambda reason: self.engine.metrics.dead_letters.labels(reason).inc(),
            max_future_s=self.settings.max_future_skew_s,
        )

    async def run_drift_check(self, group: str) -> str:
        """One drift check now over `group`; its events go on the bus for the drift rules."""
        report = await drift_check(
            self.inventory,
            self.settings.playbooks_dir,
            self.clock,
            group=group,
            batch_size=self.settings.drift.batch_size,
            forks=self.settings.drift.forks,
            env=RunEnv.of(self.settings),
            manifests=self.manifests,
        )
        await publish_report(self.engine.stores.auditor.publisher, report)
        await self.engine.auditor.note(
            self.clock.now(), "", report.line(), {"drift_check": report.summary()}
        )
        return render_report(report)

    async def _notes(self) -> None:
        """Send the grouped notifications that are due, every tick."""
        while not self.stop.is_set():
            self.engine.recorder.flush()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.settings.tick_s)

    async def _tick(self) -> None:
        last_observe = float("-inf")
        while not self.stop.is_set():
            await self.engine.tick()
            now = self.clock.now()
            if now - last_observe >= OBSERVE_EVERY_S:
                last_observe = now
                await self._observe()
            await self.engine.sweep(now)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.settings.tick_s)

    async def _observe(self) -> None:
        """Consumer lag, breaker state and connection for /metrics."""
        m = self.engine.metrics
        m.nats_connected.set(1.0 if self.bus.nc.is_connected else 0.0)
        await self._observe_partitions()
        breaker = (await self.engine.breaker.shown(self.engine.stores.unreadable))[0].state
        m.breaker_open.set(1.0 if breaker is BreakerState.OPEN else 0.0)
        m.set_one_of(m.breaker_state, breaker.value, (b.value for b in BreakerState))
        counts = node_counts(await self.engine.states.all(), self.inventory.hosts)
        for state, n in counts.items():
            m.node_states.labels(state).set(n)

    async def _observe_partitions(self) -> None:
        """Each owned partition's lag, per stream (a partition given away reads 0)."""
        if self.partitions is None:
            return
        m, mine = self.engine.metrics, set(self.partitions.ready)
        for p in range(self.settings.nats.partitions):
            for stream, telemetry in ((EVENTS, False), (TELEMETRY, True)):
                lag = 0
                name = self.partitions.names.get((telemetry, p))
                if p in mine and name is not None:
                    with contextlib.suppress(Exception):
                        info = await self.bus.js.consumer_info(stream, name)
                        lag = info.num_pending or 0
                m.partition_lag.labels(stream, str(p)).set(lag)

    async def _watch_rules(self) -> None:
        """Reload when a rule file changes (polling: works on every filesystem)."""
        seen = _mtimes(self.settings)
        self.watching.set()
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.settings.rules_poll_s)
            now = _mtimes(self.settings)
            if now != seen:
                seen = now
                await self.reload()

    async def reload(self) -> bool:
        """Load and check the rules; on any error keep the last good set and say why."""
        try:
            rules = load_rules(
                [self.settings.rules_dir], self.settings.playbooks_dir, self.inventory
            )
        except Exception as exc:  # a rule file must never take the engine down
            why = str(exc) if isinstance(exc, EngineError) else f"{type(exc).__name__}: {exc}"
            log.error("rules not reloaded, keeping the last good set:\n%s", why)
            await self.engine.auditor.note(
                self.clock.now(), "", "rule reload rejected; last good rules kept", {"errors": why}
            )
            return False
        self.rules = rules
        grade = self.settings.safety.validation_grade
        self.engine.matcher.replace(with_builtins(rules, self.catalog, grade))
        log.info("rules reloaded: %d rules", len(rules.rules))
        await self.engine.auditor.note(
            self.clock.now(),
            "",
            f"rules reloaded: {len(rules.rules)} rules",
            {"rules": [r.name for r in rules.rules]},
        )
        return True


def _mtimes(settings: Settings) -> dict[str, float]:
    try:
        return {str(p): p.stat().st_mtime for p in rule_files([settings.rules_dir])}
    except (OSError, EngineError):
        return {}


def load_world(settings: Settings) -> tuple[RuleSet, Inventory]:
    """Rules and inventory, checked before anything connects (rules by the inventory)."""
    inventory = load_inventory(settings.inventory)
    return load_rules([settings.rules_dir], settings.playbooks_dir, inventory), inventory
