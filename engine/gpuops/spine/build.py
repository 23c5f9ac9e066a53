"""One function builds the engine from settings, stores and a clock; the stage order is here.

The live engine passes KV buckets on NATS and a JetStream publisher; `replay` and
`test-rules` pass in-memory buckets and a list, and so run every stage the live engine
runs, in the same order, through the same entry.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gpuops.bus.buckets import Buckets
from gpuops.bus.publish import Publisher
from gpuops.catalog import Catalog
from gpuops.clock import Clock
from gpuops.decide.approval import ApprovalGate
from gpuops.decide.attempts import AttemptCap
from gpuops.decide.breaker import BreakerStore, FleetBreaker
from gpuops.decide.cooldown import Cooldown
from gpuops.decide.correlate import DomainCorrelation, DomainEpisode
from gpuops.decide.domains import DomainBudgets
from gpuops.decide.equivalence import Equivalence
from gpuops.decide.gates import DryRun, RecordOnly
from gpuops.decide.known_node import KnownNode
from gpuops.decide.ladder import LadderStage
from gpuops.decide.lock import NodeLock, NodeLocks
from gpuops.decide.nodegate import (
    DrainForGrade,
    EpisodeName,
    Escalate,
    FabricPeers,
    NodeReadable,
    NodeStateGate,
)
from gpuops.decide.silence import Silences, SilenceStore
from gpuops.decide.stage import Decider, Stage
from gpuops.decide.stale import StaleCutoff
from gpuops.decide.stores import Stores
from gpuops.intake.answers import Answers
from gpuops.inventory.domains import FACILITY, Domains
from gpuops.inventory.hosts import Inventory
from gpuops.match.builtin import with_builtins
from gpuops.match.facts import Telemetry
from gpuops.match.matcher import Matcher
from gpuops.match.rules import RuleSet
from gpuops.models import Decision
from gpuops.power.budgets import Overrides
from gpuops.power.controller import PowerController
from gpuops.power.domains import domain_response
from gpuops.power.engine import (
    POWER_RULE,
    PowerEngine,
    Sharing,
    node_policies,
    observer,
    power_rule,
)
from gpuops.power.guard import YieldToBudget
from gpuops.record.approvals import ApprovalStore
from gpuops.record.audit import Auditor
from gpuops.record.episodes import Episodes, EpisodeTimes, episode_records
from gpuops.record.metrics import Metrics
from gpuops.record.nodestate import NodeStates
from gpuops.record.notify import Notifier
from gpuops.record.outbox import Grouping, Outbox
from gpuops.record.recorder import Recorder
from gpuops.settings import Settings
from gpuops.spine.pipeline import Pipeline, Whole

__all__ = ["Buckets", "Engine", "build_engine"]

# How often, on the engine's clock, what time alone ends is swept (`Engine.sweep`).
SWEEP_EVERY_S = 10.0


@dataclass
class Engine:
    """The built pipeline and the stores people and loops act on."""

    pipeline: Pipeline
    recorder: Recorder
    stores: Stores
    metrics: Metrics
    notifier: Notifier
    power: PowerEngine
    answers: Answers
    _swept: float = field(default=float("-inf"), init=False, repr=False)

    async def tick(self) -> list[Decision]:
        """What the engine decides from time rather than from an event, every tick: silence
        (`absent` rules) and the approvals people answered; then the dry-run switch is
        read again. Live (`App`) and shadow mode both call this."""
        decisions = await self.pipeline.tick()
        decisions += await self.answers.settle()
        await self.stores.dry_run.read()
        return decisions

    async def sweep(self, now: float) -> None:
        """Every SWEEP_EVERY_S of the clock, what time alone ends: a validation whose probe
        never came (the node to a person), quiet episodes, windows of keys gone quiet, a
        GPU's day of density. Live (`App`, after each tick) and shadow mode (as its clock
        moves) both call this, so a replay ends them when the engine would have."""
        if now - self._swept < SWEEP_EVERY_S:
            return
        self._swept = now
        await self.recorder.sweep()
        self.matcher.sweep(now)
        self.pipeline.density.sweep(now)

    @property
    def matcher(self) -> Matcher:
        """The rules and their windows."""
        return self.pipeline.matcher

    @property
    def auditor(self) -> Auditor:
        """The audit trail's writer."""
        return self.recorder.auditor

    @property
    def buckets(self) -> Buckets:
        """The KV buckets the stores are over."""
        return self.stores.buckets

    @property
    def approvals(self) -> ApprovalStore:
        """Held decisions."""
        return self.stores.approvals

    @property
    def breaker(self) -> BreakerStore:
        """The fleet breaker's records."""
        return self.stores.breaker

    @property
    def silences(self) -> SilenceStore:
        """Silences and maintenance windows."""
        return self.stores.silences

    @property
    def states(self) -> NodeStates:
        """Each node's lifecycle state."""
        return self.stores.states

    @property
    def locks(self) -> NodeLocks:
        """One remediation at a time per node."""
        return self.stores.locks


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
    observers: Sequence[Callable[[Telemetry], None]] = (),
    sharing: Sharing | None = None,
    metrics: Metrics | None = None,
) -> Engine:
    """Match -> decide (the stages below, in this order) -> intent -> record.

    Everything is wired here: `observers` see every telemetry sample (the console's
    heatmap), `sharing` says which nodes this replica decides for (gpuops.scale; one
    engine: all of them), and the power controller and people's answers hand their
    requests to the pipeline's one entry."""
    s, notifier = settings.safety, notifier or Notifier()
    sharing = sharing or Whole()
    metrics = metrics or Metrics()
    stores = Stores.over(buckets, publisher, settings.dry_run, metrics, clock)

    async def tripped(why: str) -> None:
        notifier.notify("breaker open", f"automation stopped: {why}; reset it when understood")

    domains = Domains.of(inventory)

    async def domain_opened(episode: DomainEpisode) -> None:
        await domain_response(Overrides(buckets.control), controller, notifier)(episode)

    stages: list[Stage] = [
        KnownNode(inventory),
        StaleCutoff(s.stale_after_s, settings.max_future_skew_s),
        NodeStateGate(stores.states, catalog.returning()),
        Escalate(),
        YieldToBudget(buckets.control, settings.power, catalog),  # budgeted GPUs
        Silences(stores.silences, inventory),
        # A fault on many nodes of one domain is the domain's: held before the cooldown
        # and the ladder count it as the node's.
        DomainCorrelation(buckets.control, domains, domain_opened),
        Cooldown(buckets.cooldowns, catalog),
        # Picks the rung: the stages below judge its playbook.
        LadderStage(buckets.history, stores.locks),
        # No stage below acts on, drops or keeps anything for a proposal with no playbook,
        # and none gives it one: a rule that records only is decided here.
        RecordOnly(),
        Equivalence(buckets.history, catalog, s.equivalence_window_s),
        NodeReadable(stores.states),  # whatever acts reads its node's state record
        EpisodeName(episode_records(buckets.nodes)),  # read with it: the episode acted on
        # A grade that loads every GPU, asked for a node in service: a drain, then the gate.
        DrainForGrade(stores.states, catalog.diagnosing(), catalog.isolating()),
        FabricPeers(stores.states, inventory, catalog.diagnosing(), domains, stores.locks),
        NodeLock(stores.locks, s.lock_lease_s),
        AttemptCap(buckets.history, catalog, s.attempt_cap, s.attempt_window_s),
        DomainBudgets(
            buckets.control,
            catalog,
            domains,
            {kind: budget.limit for kind, budget in s.domain_budgets.items()},
            s.domain_window_s,
        ),
        FleetBreaker(
            stores.breaker,
            catalog,
            len(inventory.hosts - inventory.group_hosts(FACILITY)),  # GPU nodes, not CDUs
            share=s.breaker_share,
            absolute=s.breaker_absolute,
            floor=s.breaker_floor,
            window_s=s.breaker_window_s,
            on_trip=tripped,
        ),
        DryRun(),
        ApprovalGate(),
    ]
    recorder = _recorder(settings, stores, catalog, notifier, clock, metrics)
    controller = PowerController(settings.power, node_policies(inventory, settings.power))
    pipeline = Pipeline(
        Matcher(with_builtins(rules, catalog, s.validation_grade), clock, inventory=inventory),
        Decider(stages, clock, stores.dry_run, stores.unreadable),
        recorder,
        publisher,
        clock,
        inventory,
        metrics,
        signing_key,
        requests={POWER_RULE: power_rule(catalog)},
        observers=(observer(controller), *observers),
        owner=sharing,
    )
    power = PowerEngine(
        settings.power,
        inventory,
        buckets.control,
        controller,
        pipeline.handle,
        sharing,
        recorder,
        clock,
    )
    answers = Answers(stores.approvals, pipeline.handle, sharing.owns, recorder, clock)
    return Engine(pipeline, recorder, stores, metrics, notifier, power, answers)


def _recorder(
    settings: Settings,
    stores: Stores,
    catalog: Catalog,
    notifier: Notifier,
    clock: Clock,
    metrics: Metrics,
) -> Recorder:
    """The record stage: audit, node state, episodes and what people are told."""
    n, s = settings.notifications, settings.safety
    outbox = Outbox(notifier, Grouping(n.group_wait_s, n.group_interval_s, n.storm_nodes))
    episodes = Episodes(
        stores.buckets.nodes,
        catalog,
        clock,
        outbox,
        metrics,
        stores.auditor,
        EpisodeTimes(n.repeat_interval_s, n.resolve_after_s),
    )
    return Recorder(
        stores.auditor,
        stores.states,
        stores.approvals,
        catalog,
        notifier,
        clock,
        episodes,
        outbox,
        s.approval_timeout_s,
        s.validation_timeout_s,
        stores.unreadable,
    )
