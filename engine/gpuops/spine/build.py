"""One function builds the engine from settings, stores and a clock; the stage order is here.

The live engine passes KV buckets on NATS and a JetStream publisher; `replay` and
`test-rules` pass in-memory buckets and a list, and so run every stage the live engine
runs, in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuops.bus.conn import Bus
from gpuops.bus.publish import Publisher
from gpuops.bus.store import KV, MemoryKV, NatsKV
from gpuops.catalog import Catalog
from gpuops.clock import Clock
from gpuops.decide.approval import ApprovalGate
from gpuops.decide.attempts import AttemptCap
from gpuops.decide.breaker import BreakerStore, FleetBreaker
from gpuops.decide.cooldown import Cooldown
from gpuops.decide.equivalence import Equivalence
from gpuops.decide.gates import DryRun, RecordOnly
from gpuops.decide.known_node import KnownNode
from gpuops.decide.ladder import LadderStage
from gpuops.decide.lock import NodeLock, NodeLocks
from gpuops.decide.nodegate import Escalate, NodeStateGate
from gpuops.decide.silence import Silences, SilenceStore
from gpuops.decide.stage import Decider, Stage
from gpuops.decide.stale import StaleCutoff
from gpuops.inventory.hosts import Inventory
from gpuops.match.builtin import with_builtins
from gpuops.match.matcher import Matcher
from gpuops.match.rules import RuleSet
from gpuops.power.engine import PowerEngine
from gpuops.power.guard import YieldToBudget
from gpuops.record.approvals import ApprovalStore
from gpuops.record.audit import Auditor
from gpuops.record.episodes import Episodes, EpisodeTimes
from gpuops.record.metrics import Metrics
from gpuops.record.nodestate import NodeStates
from gpuops.record.notify import Notifier
from gpuops.record.outbox import Grouping, Outbox
from gpuops.record.recorder import Recorder
from gpuops.settings import Settings
from gpuops.spine.pipeline import Pipeline


@dataclass(frozen=True, slots=True)
class Buckets:
    """The KV stores by purpose."""

    locks: KV
    cooldowns: KV
    history: KV
    control: KV
    nodes: KV
    claims: KV

    @classmethod
    def on(cls, bus: Bus) -> Buckets:
        """The JetStream buckets of a connected bus."""
        kv = bus.kv
        return cls(
            *(
                NatsKV(kv[n])
                for n in ("locks", "cooldowns", "history", "control", "nodes", "claims")
            )
        )

    @classmethod
    def memory(cls) -> Buckets:
        """Fresh in-memory buckets."""
        return cls(MemoryKV(), MemoryKV(), MemoryKV(), MemoryKV(), MemoryKV(), MemoryKV())


@dataclass
class Engine:
    """The built pipeline and the stores people and loops act on."""

    pipeline: Pipeline
    recorder: Recorder
    approvals: ApprovalStore
    breaker: BreakerStore
    silences: SilenceStore
    states: NodeStates
    locks: NodeLocks
    metrics: Metrics
    notifier: Notifier
    buckets: Buckets
    power: PowerEngine

    @property
    def matcher(self) -> Matcher:
        """The rules and their windows."""
        return self.pipeline.matcher

    @property
    def auditor(self) -> Auditor:
        """The audit trail's writer."""
        return self.recorder.auditor


def build_engine(
    settings: Settings,
    *,
    rules: RuleSet,
    inventory: Inventory,
    catalog: Catalog,
    buckets: Buckets,
    publisher: Publisher,
    clock: Clock,
    signing_key: bytes,
    notifier: Notifier | None = None,
) -> Engine:
    """Match -> decide (the stages below, in this order) -> intent -> record."""
    s, notifier = settings.safety, notifier or Notifier()
    states, locks = NodeStates(buckets.nodes), NodeLocks(buckets.locks)
    silences, breaker = SilenceStore(buckets.control), BreakerStore(buckets.control)

    async def tripped(why: str) -> None:
        notifier.notify("breaker open", f"automation stopped: {why}; reset it when understood")

    stages: list[Stage] = [
        KnownNode(inventory),
        StaleCutoff(s.stale_after_s, settings.max_future_skew_s),
        NodeStateGate(states),
        Escalate(),
        YieldToBudget(buckets.control, settings.power),  # budgeted GPUs: the controller's
        Silences(silences, inventory),
        Cooldown(buckets.cooldowns, catalog),
        LadderStage(buckets.history),  # picks the rung: the stages below judge its playbook
        Equivalence(buckets.history, catalog, s.equivalence_window_s),
        NodeLock(locks, s.lock_lease_s),
        AttemptCap(buckets.history, catalog, s.attempt_cap, s.attempt_window_s),
        FleetBreaker(
            breaker,
            catalog,
            len(inventory.hosts),
            share=s.breaker_share,
            absolute=s.breaker_absolute,
            window_s=s.breaker_window_s,
            on_trip=tripped,
        ),
        RecordOnly(),
        DryRun(),
        ApprovalGate(),
    ]
    metrics = Metrics()
    approvals = ApprovalStore(buckets.control)
    n = settings.notifications
    outbox = Outbox(
        notifier,
        Grouping(n.group_wait_s, n.group_interval_s, n.storm_nodes),
        inhibited_by=lambda: episodes.node_level(),
    )
    auditor = Auditor(publisher)
    episodes = Episodes(
        buckets.nodes,
        catalog,
        clock,
        outbox,
        metrics,
        auditor,
        EpisodeTimes(n.repeat_interval_s, n.resolve_after_s),
    )
    recorder = Recorder(
        auditor,
        states,
        approvals,
        catalog,
        notifier,
        clock,
        episodes,
        outbox,
        s.approval_timeout_s,
        s.validation_timeout_s,
    )
    matcher = Matcher(with_builtins(rules, catalog), clock, inventory=inventory)
    decider = Decider(stages, clock, settings.dry_run)
    pipeline = Pipeline(
        matcher, decider, recorder, publisher, clock, inventory, metrics, signing_key
    )
    power = PowerEngine(settings.power, inventory, buckets.control, pipeline, recorder, clock)
    pipeline.observers.append(power.observe)
    return Engine(
        pipeline,
        recorder,
        approvals,
        breaker,
        silences,
        states,
        locks,
        metrics,
        notifier,
        buckets,
        power,
    )
