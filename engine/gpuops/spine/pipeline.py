"""One event through match, decide, act (the intent) and record, in that order.

`Pipeline.handle` is the one entry: events from the bus, and the decisions the engine
asks for itself (`Request`: a power change, an approved match), which skip matching
only. Nothing else calls into the stages.

The event handed in is acked by the intake only after `handle` returns, and `handle`
returns only after every intent is stored in the actions queue and every decision is
in the audit stream. The intents of a decision are stored before any stage commits
what it remembers, and every commit is idempotent by event id, so a crash at any point
either leaves nothing or lets the redelivered event decide the same again. The record
of a decision (audit, node state, episode) is as idempotent, so it is written alongside
the commits rather than after them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from gpuops.bus.client import transient
from gpuops.bus.publish import Publisher
from gpuops.bus.store import together
from gpuops.clock import Clock
from gpuops.decide.stage import Decider
from gpuops.errors import LeaseLost
from gpuops.inventory.hosts import Inventory
from gpuops.match.facts import Telemetry, as_telemetry
from gpuops.match.matcher import Matcher
from gpuops.match.rules import Rule
from gpuops.models import GATE_KIND, Decision, Event, Intent, Match, Request, action_subject
from gpuops.record.audit import Auditor
from gpuops.record.density import DensityTracker
from gpuops.record.episodes import episode_id
from gpuops.record.metrics import Children, Metrics
from gpuops.record.recorder import Recorder
from gpuops.signing import sign

log = logging.getLogger(__name__)

# Events from hosts outside the inventory are counted, and summarised in the audit at
# most once per period: a flood of made-up names must not grow state or the trail.
UNKNOWN_REPORT_S = 60.0

# A decision the bus failed (NATS slow or away, a record contended) is decided again this
# many times, after pauses of 0.1, 0.2 and 0.4 s, before its event's handling fails: a
# telemetry sample is acked with its batch, so a failed one is not redelivered.
DECIDE_TRIES = 4
DECIDE_PAUSE_S = 0.1


def intent_key(rule: str, key: str, event_id: str, playbook: str) -> str:
    """The idempotency key of one action: rule, group key, triggering event, playbook."""
    return hashlib.sha256(f"{rule}|{key}|{event_id}|{playbook}".encode()).hexdigest()[:40]


class Owner(Protocol):
    """Which nodes this engine decides for now (gpuops.scale: its partitions' leases)."""

    def owns(self, node: str) -> bool:
        """Whether this replica decides for the node now."""
        ...


class Whole:
    """One engine for the whole fleet: it decides for every node (replay, a lone engine)."""

    def owns(self, node: str) -> bool:
        """Always."""
        return True

    def shared_with_others(self, nodes: frozenset[str]) -> bool:
        """Never."""
        return False


class Pipeline:
    """Match, decide, write intents, record: one entry, `handle`, for events and requests."""

    def __init__(
        self,
        matcher: Matcher,
        decider: Decider,
        recorder: Recorder,
        publisher: Publisher,
        clock: Clock,
        inventory: Inventory,
        metrics: Metrics,
        signing_key: bytes,
        *,
        requests: Mapping[str, Rule] | None = None,
        observers: Sequence[Callable[[Telemetry], None]] = (),
        owner: Owner | None = None,
        density: DensityTracker | None = None,
    ) -> None:
        self.matcher = matcher
        self.density = density or DensityTracker()
        self.decider = decider
        self.recorder = recorder
        self.publisher = publisher
        self.clock = clock
        self.inventory = inventory
        self.metrics = metrics
        self.signing_key = signing_key
        # The rules the engine's own requests are decided under (no event matches them).
        self.requests: Mapping[str, Rule] = requests or {}
        # Called with every telemetry sample from a known host before matching: the
        # density report's day of utilisation, the power controller, the console.
        self.observers = (self.density.observe, *observers)
        # Asked before every decision and again before its intents are written.
        self.owner: Owner = owner or Whole()
        self._unknown: dict[str, int] = {}
        self._unknown_reported = float("-inf")
        m = metrics
        self._events, self._matches = Children(m.events), Children(m.matches)
        self._decisions, self._latency = Children(m.decisions), Children(m.event_to_decision)

    @property
    def auditor(self) -> Auditor:
        """Where decisions are recorded."""
        return self.recorder.auditor

    async def handle(self, item: Event | Telemetry | Request) -> list[Decision]:
        """Everything the engine does with one event (telemetry: expanded to facts once) or
        one of its own requests; the decisions made, in order."""
        if isinstance(item, Request):
            return await self._request(item)
        self._events(item.kind).inc()
        if item.node not in self.inventory:
            await self._unknown_node(item)
            return []
        self._fence(item.node)
        event: Event | Telemetry = item
        telemetry = as_telemetry(item)
        if telemetry is not None:
            event = telemetry
            for observe in self.observers:
                observe(telemetry)
        matches = self.matcher.match(event)
        # Most samples match nothing and clear nothing: no awaits for them (each costs a
        # coroutine, and this runs for every event).
        decisions = [await self._decide(match) for match in matches] if matches else []
        if self.matcher.has_cleared():
            await self.settle_cleared()
        return [d for d in decisions if d is not None]

    async def settle_cleared(self) -> None:
        """Conditions that went false on keys that had fired: their episodes may be over."""
        for rule, node, gpu, at in self.matcher.take_cleared():
            await self.recorder.cleared(rule, node, gpu, at)

    async def tick(self) -> list[Decision]:
        """Matches that come from silence rather than from an event; the decisions made."""
        decisions = []
        for match in self.matcher.tick(self.clock.now()):
            if self.owner.owns(match.node):  # a silence of a node another replica now hears
                decisions.append(await self._decide(match))
        await self._report_unknown(force=False)
        return [d for d in decisions if d is not None]

    async def _request(self, request: Request) -> list[Decision]:
        """A power change or an approved match: decided like any match, under the engine's
        rule for it, or the loaded rule the held match fired (gone: nothing decided)."""
        name = request.match.rule
        rule = self.requests.get(name) or self.matcher.rules.get(name)
        if rule is None:
            return []
        d = await self._decide(request.match, rule, request.approved_by)
        return [] if d is None else [d]

    async def _decide(
        self, match: Match, rule: Rule | None = None, approved_by: str | None = None
    ) -> Decision | None:
        """Decide one match, store its intents, record the decision."""
        rule = rule or self.matcher.rules.get(match.rule)
        if rule is None:
            return None
        match, rule = self._climbing(match, rule)
        self._fence(match.node)
        self._matches(match.rule).inc()
        intents: list[Intent] = []

        async def write(d: Decision) -> None:
            self._fence(match.node)  # the lease may have run out while the stages read KV
            intents.clear()  # a decision decided again writes its own intents, once
            if d.accepted:
                now = self.clock.now()
                # The open episode the stages found, or the one this decision opens, named
                # for its event's time: a redelivery after a crash (its intents stored, the
                # record not) names the same episode the stored intents carry.
                episode = d.episode or episode_id(match.rule, match.node, match.event_ts)
                intents.extend(self._intents(d, now, episode))
            # Each intent is stored once by its key, so they go together: a crash half-way
            # lets the redelivered event store them all again, the stored ones as no-ops.
            await together(*(self._store(intent) for intent in intents))

        counted = False  # one match is one decision in the metrics

        async def record(d: Decision) -> None:
            nonlocal counted
            if not counted:  # a decision decided again is counted once, as it is audited once
                counted = True
                self._decisions(d.reason.value).inc()
                self._latency(match.rule).observe(max(0.0, self.clock.now() - match.event_ts))
            await self.recorder.decided(d, intents)

        for attempt in range(DECIDE_TRIES - 1):
            try:
                return await self.decider.decide(match, rule, write, approved_by, record)
            except Exception as exc:
                if not transient(exc):
                    raise
                # Every stage's entry and every write is idempotent by event id, so the
                # decision made again is the one the first try would have made.
                log.warning(
                    "deciding %s for %s failed (%s); deciding it again", match.rule, match.node, exc
                )
                await asyncio.sleep(DECIDE_PAUSE_S * 2**attempt)
        return await self.decider.decide(match, rule, write, approved_by, record)

    def _climbing(self, match: Match, rule: Rule) -> tuple[Match, Rule]:
        """A failed gate is decided as its fault recurring: under the fault's own rule, for
        the fault's group key, while the node is still out, so the fault's ladder takes
        its next rung (or hands the node to a person at its end). A fault whose rule has
        no ladder, or is gone, stays with the gate's rule, which hands it to a person."""
        if not rule.climbs:
            return match, rule
        fault = self.matcher.rules.get(str(match.facts.get("fault_rule") or ""))
        if fault is None or fault.ladder is None:
            return match, rule
        key = str(match.facts.get("fault_key") or match.key)
        again = match.model_copy(update={"rule": fault.name, "key": key, "kind": GATE_KIND})
        return again, dataclasses.replace(fault, states=rule.states)

    async def _store(self, intent: Intent) -> None:
        await self.publisher.publish(
            action_subject(intent.node), intent.model_dump_json().encode(), intent.key
        )
        self.metrics.intents.inc()

    def _fence(self, node: str) -> None:
        """Refuse to decide for a node whose partition this replica does not hold now: the
        event is not acked, and its partition's owner decides it."""
        if not self.owner.owns(node):
            raise LeaseLost(f"partition of {node} is not held by this replica")

    def _intents(self, d: Decision, now: float, episode: str) -> list[Intent]:
        m = d.match
        return [
            sign(
                Intent(
                    key=intent_key(m.rule, m.key, m.event_id, action.playbook),
                    rule=m.rule,
                    node=m.node,
                    gpu=m.gpu,
                    gpus=m.gpus,
                    action=action,
                    event_id=m.event_id,
                    event_ts=m.event_ts,
                    decided_at=now,
                    decision=d,
                    episode=episode,
                ),
                self.signing_key,
            )
            for action in d.actions
        ]

    async def _unknown_node(self, event: Event | Telemetry) -> None:
        self.metrics.unknown_nodes.inc()
        if len(self._unknown) < 1000 or event.node in self._unknown:
            self._unknown[event.node] = self._unknown.get(event.node, 0) + 1
        else:
            self._unknown["(others)"] = self._unknown.get("(others)", 0) + 1
        await self._report_unknown(force=False)

    async def _report_unknown(self, force: bool) -> None:
        """One audit note per period naming the unknown hosts seen (never acted upon)."""
        now = self.clock.now()
        if not self._unknown or (not force and now - self._unknown_reported < UNKNOWN_REPORT_S):
            return
        seen, self._unknown = self._unknown, {}
        self._unknown_reported = now
        top = sorted(seen.items(), key=lambda kv: -kv[1])[:20]
        log.warning("events from %d hosts not in the inventory: never acted upon", len(seen))
        await self.auditor.note(
            now,
            "",
            f"{sum(seen.values())} events from {len(seen)} hosts not in the inventory; "
            "never acted upon",
            {"hosts": dict(top)},
        )
