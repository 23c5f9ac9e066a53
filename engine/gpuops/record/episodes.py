"""Episodes: one fault on one node under one rule, from its first match to its recovery.

Decisions come per sample (a `for:` rule matches every second it stays true); people
want to hear of a fault once. An episode opens on the first decision of a rule on a
node, folds in the later ones (counted, not told), escalates at most once (needs_human,
attempt cap, breaker), is told again only after `repeat_interval_s`, and resolves when
the fault is gone:

- a telemetry rule's condition went false on every GPU it held on (the matcher reports
  the first false sample), or an alert rule's alerts were resolved, and
- where the remediation's playbook validates, the validation probe passed;
- a rule on other events (an XID, a lost heartbeat) that needs no probe resolves after
  `resolve_after_s` without a new match;
- any other episode with no match for `QUIET_FACTOR` times that long resolves too (the
  node went quiet, a rule changed, a probe never came): an episode never stays open
  forever.

Detect, decide, run and recover times are kept on the episode and go to `/metrics` as
histograms when it resolves. The audit trail still has every decision.

Writes go to KV with compare-and-set (the executor adds run times to the same record);
per-sample touches stay in memory and are written with the next change or the sweep.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from gpuops.bus.store import KV, Store
from gpuops.catalog import Catalog
from gpuops.clock import Clock
from gpuops.models import NOT_FAULT_KINDS, STATEFUL_KINDS, Decision, Intent, Reason, RunOutcome
from gpuops.record.audit import Auditor
from gpuops.record.metrics import Metrics
from gpuops.record.nodestate import NodeRecord, fault_name
from gpuops.record.outbox import Outbox, Tell

log = logging.getLogger(__name__)

# Drops that hand a node to a person.
ESCALATIONS = frozenset(
    {Reason.NEEDS_HUMAN, Reason.ATTEMPT_CAP, Reason.BREAKER_OPEN, Reason.DOMAIN_BUDGET}
)
# Decisions that are about a fault (the others say the match did not apply here).
NOT_FAULTS = frozenset(
    {Reason.NOT_APPLICABLE, Reason.UNKNOWN_NODE, Reason.STALE, Reason.POWER_BUDGET}
    | {Reason.DOMAIN_WAIT, Reason.DOMAIN_HELD}  # the domain's episode, not the node's
)
VALIDATION_PASSED = "validation-passed"
QUIET_FACTOR = 12  # with resolve_after_s 5 min: an hour without a match
# Which open fault leads a node's reason when it has several: the severest, since one
# fault often brings the others (a GPU off the bus, critical, can stop the node's agent:
# the silent agent, a warning, is then its symptom); between equals, the first to open.
SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}


class Episode(BaseModel):
    """What is known of one fault; times are epoch seconds (`detected_at` is event time)."""

    model_config = ConfigDict(frozen=True)

    rule: str
    node: str
    level: str  # "gpu" or "node": a node-level episode inhibits the GPU-level ones' notes
    severity: str = "warning"
    summary: str = ""
    on_telemetry: bool = False  # resolves when its condition goes false (telemetry, alert)
    gpus: tuple[int, ...] = ()  # GPUs whose condition still held at the last match
    detected_at: float
    opened_at: float
    last_seen: float
    samples: int = 1
    decided_at: float | None = None  # the first accepted decision
    probed: bool = False  # the remediation is probed before the node returns
    validated_at: float | None = None
    cleared_at: float | None = None
    run_started: float | None = None
    run_ended: float | None = None
    run_status: str = ""
    escalated: str = ""  # the reason it went to a person
    notified_at: float | None = None
    resolved_at: float | None = None
    why_resolved: str = ""

    @property
    def id(self) -> str:
        """Stable name for people: rule, node and the second it opened."""
        return episode_id(self.rule, self.node, self.opened_at)

    @property
    def recovered(self) -> bool:
        """The fault condition is gone and, where needed, the probe passed."""
        cleared = self.cleared_at is not None or not self.on_telemetry
        return cleared and (not self.probed or self.validated_at is not None)


def episode_id(rule: str, node: str, opened_at: float) -> str:
    """An episode's name: what Slurm's drain reason and people's tools show."""
    return f"{rule}@{node}:{int(opened_at)}"


@dataclass(frozen=True, slots=True)
class EpisodeTimes:
    """How an episode's settings shape what people are told."""

    repeat_interval_s: float = 4 * 3600.0
    resolve_after_s: float = 300.0


def episode_records(kv: KV) -> Store[Episode]:
    """The episode records in the nodes bucket."""
    return Store(kv, Episode, "episode")


class Episodes:
    """Opens, folds, escalates and resolves episodes; tells people through the outbox."""

    def __init__(
        self,
        kv: KV,
        catalog: Catalog,
        clock: Clock,
        outbox: Outbox,
        metrics: Metrics,
        auditor: Auditor,
        times: EpisodeTimes | None = None,
    ) -> None:
        self.store = episode_records(kv)
        self.auditor = auditor
        self.catalog = catalog
        self.clock = clock
        self.outbox = outbox
        self.metrics = metrics
        self.times = times or EpisodeTimes()
        self.open: dict[tuple[str, str], Episode] = {}
        # The last decision folded into each open episode (its event and verdict): the
        # same decision folded again (decided again after its audit write failed) is
        # not one more sample, nor one more notification.
        self._folded: dict[tuple[str, str], tuple[str, Reason]] = {}
        self._loaded = False  # the episodes a previous run left open are read on first sweep

    async def decided(self, d: Decision, opened_at: float | None = None) -> None:
        """Fold one decision into its episode (opening one on the first, at `opened_at`
        where its intents already name it: their event's time; else now)."""
        m = d.match
        if d.reason in NOT_FAULTS:
            return
        if m.rule == VALIDATION_PASSED and d.accepted:
            await self.validated(m.node, m.at)
            return
        if m.kind in NOT_FAULT_KINDS:
            return  # a person's command, the power controller's request: not a fault
        now, key = self.clock.now(), (m.rule, m.node)
        folded = (m.event_id, d.reason)
        if self._folded.get(key) == folded and key in self.open:
            return
        ep = self.open.get(key) or await self._load(key)
        first = ep is None
        if ep is None:
            ep = Episode(
                rule=m.rule,
                node=m.node,
                level="gpu" if m.gpus else "node",
                severity=m.severity,
                summary=_summary(d),
                on_telemetry=m.kind in STATEFUL_KINDS,
                gpus=m.gpus,
                detected_at=m.event_ts,
                opened_at=now if opened_at is None else opened_at,
                last_seen=now,
            )
        else:
            gpus = tuple(sorted({*ep.gpus, *m.gpus}))
            ep = ep.model_copy(update={"last_seen": now, "samples": ep.samples + 1, "gpus": gpus})
        changes = self._changes(ep, d, now)
        if first or changes:
            ep = await self._write(key, ep.model_copy(update=changes), first)
        self.open[key] = ep
        self._folded[key] = folded
        incident = None
        if d.notify and d.reason in (Reason.ACCEPTED, Reason.NO_ACTION):
            plays = ", ".join(a.playbook for a in d.actions) or "nothing to run"
            incident = f"{ep.summary} ({ep.severity}): {plays}"
        self._tell(ep, now, bool(changes.get("escalated")), incident)

    def _changes(self, ep: Episode, d: Decision, now: float) -> dict[str, object]:
        out: dict[str, object] = {}
        if d.accepted and ep.decided_at is None:
            out["decided_at"] = now
            out["probed"] = any(
                (s := self.catalog.get(a.playbook)) is not None and s.validate_after
                for a in d.actions
            )
            self.metrics.detect_to_decide.labels(ep.rule).observe(max(0.0, now - ep.detected_at))
        if d.reason in ESCALATIONS and not ep.escalated:
            out["escalated"] = d.reason.value
            out["summary"] = f"{ep.summary}; {d.detail}" if d.detail else ep.summary
        return out

    def _tell(
        self, ep: Episode, now: float, escalated: bool = False, incident: str | None = None
    ) -> None:
        """Once per episode (and per escalation), then once per repeat interval."""
        told = ep.notified_at is not None
        due = not told or now - (ep.notified_at or 0.0) >= self.times.repeat_interval_s
        if escalated or (ep.escalated and told and due):
            self._send(ep, "needs-human", ep.summary, now)
        elif incident is not None and due:
            self._send(ep, "incident", incident, now)

    def _send(self, ep: Episode, topic: str, text: str, now: float) -> None:
        self.outbox.add(Tell(topic, ep.rule, ep.node, ep.level, text, ep.id), now)
        ep = ep.model_copy(update={"notified_at": now})
        self.open[(ep.rule, ep.node)] = ep

    async def cleared(self, rule: str, node: str, gpu: int | None, at: float) -> None:
        """The rule's condition went false for a key (a GPU, or the node)."""
        key = (rule, node)
        ep = self.open.get(key)
        if ep is None:
            return
        left = tuple(g for g in ep.gpus if g != gpu) if gpu is not None else ()
        if left:
            self.open[key] = ep.model_copy(update={"gpus": left})
            return
        ep = ep.model_copy(update={"gpus": (), "cleared_at": at})
        await self._settle(key, ep, "the condition cleared")

    async def validated(self, node: str, at: float) -> None:
        """The node's validation probe passed: its probed remediations are done."""
        for key, ep in list(self.open.items()):
            if ep.node == node and ep.probed and ep.validated_at is None:
                await self._settle(key, ep.model_copy(update={"validated_at": at}), "probe passed")

    async def _settle(self, key: tuple[str, str], ep: Episode, why: str) -> None:
        if ep.recovered:
            await self._resolve(key, ep, why)
        else:
            self.open[key] = await self._write(key, ep, False)

    async def _resolve(self, key: tuple[str, str], ep: Episode, why: str) -> None:
        now = self.clock.now()
        done = ep.model_copy(update={"resolved_at": now, "why_resolved": why})
        done = await self._write(key, done, False)  # with the run times the executor added
        self.open.pop(key, None)
        self._folded.pop(key, None)
        await self.auditor.note(
            now,
            ep.node,
            f"episode {ep.id} resolved: {why} after {now - ep.detected_at:.0f}s",
            {"episode": done.model_dump(mode="json")},
        )
        self.metrics.detect_to_recover.labels(ep.rule).observe(max(0.0, now - ep.detected_at))
        self.metrics.episodes_open.set(len(self.open))
        if ep.notified_at is not None:
            took = now - ep.detected_at
            self.outbox.add(
                Tell("resolved", ep.rule, ep.node, ep.level, f"{why} after {took:.0f}s", ep.id),
                now,
            )

    async def run_started(self, intent: Intent) -> None:
        """The executor began the episode's remediation."""
        now = self.clock.now()
        self.metrics.decide_to_run.labels(intent.action.playbook).observe(
            max(0.0, now - intent.decided_at)
        )

        def change(ep: Episode | None) -> Episode | None:
            if ep is None or ep.resolved_at is not None or ep.run_started is not None:
                return None
            return ep.model_copy(update={"run_started": now})

        await self.store.update(change, intent.rule, intent.node)

    async def run_ended(self, intent: Intent, outcome: RunOutcome) -> None:
        """The remediation's run ended."""
        self.metrics.run_duration.labels(outcome.playbook).observe(outcome.duration_s)

        def change(ep: Episode | None) -> Episode | None:
            if ep is None or ep.resolved_at is not None:
                return None
            return ep.model_copy(
                update={"run_ended": outcome.ended, "run_status": outcome.status.value}
            )

        await self.store.update(change, intent.rule, intent.node)

    async def sweep(self) -> None:
        """Resolve quiet episodes that have no condition to clear; repeat escalations that
        are due; write what per-sample touches changed (last seen, samples, GPUs)."""
        now = self.clock.now()
        if not self._loaded:
            for ep in await read_open(self.store):
                self.open.setdefault((ep.rule, ep.node), ep)
            self._loaded = True
        for key, ep in list(self.open.items()):
            wait = self.times.resolve_after_s
            if ep.on_telemetry or ep.probed:
                wait *= QUIET_FACTOR
            if now - ep.last_seen >= wait:
                await self._resolve(key, ep, f"no match for {wait:.0f}s")
            else:
                self._tell(ep, now)
                self.open[key] = await self._write(key, self.open[key], False)
        self.metrics.episodes_open.set(len(self.open))

    def node_level(self) -> set[str]:
        """Nodes with an open node-level episode (they inhibit GPU-level notes)."""
        return {ep.node for ep in self.open.values() if ep.level == "node"}

    async def all_open(self) -> list[Episode]:
        """Open episodes, from KV (every replica's and the executor's view)."""
        return await read_open(self.store)

    async def _load(self, key: tuple[str, str]) -> Episode | None:
        found, _ = await self.store.get(*key)
        return found if found is not None and found.resolved_at is None else None

    async def _write(self, key: tuple[str, str], ep: Episode, first: bool) -> Episode:
        """Store the engine's view, keeping what the executor added (run times)."""

        def change(stored: Episode | None) -> Episode:
            if stored is None or stored.resolved_at is not None or first:
                return ep
            runs = {"run_started", "run_ended", "run_status"}
            return ep.model_copy(update={k: getattr(stored, k) for k in runs})

        written = await self.store.update(change, *key)
        if first:
            self.metrics.episodes_open.set(len(self.open) + 1)
        return written or ep


def _summary(d: Decision) -> str:
    m = d.match
    where = f"{m.node} GPU {','.join(map(str, m.gpus))}" if m.gpus else m.node
    return f"{m.rule} on {where}"


def episode_line(ep: Episode, now: float) -> str:
    """One line for an open episode, for `status` and ChatOps: what people see instead of
    the samples behind it."""
    state = f"escalated ({ep.escalated})" if ep.escalated else "remediating"
    if ep.decided_at is None and not ep.escalated:
        state = "open"
    return f"{ep.id}: {ep.summary}, {state}, {ep.samples} samples, open {now - ep.opened_at:.0f}s"


async def read_open(store: Store[Episode]) -> list[Episode]:
    """Open episodes as KV has them (every replica's and the executor's view), oldest first.
    One that does not decode is left out: episodes group what people are told and gate
    nothing (`gpuops status` names it)."""
    readable, _ = await store.readable()
    found = [ep for _, ep in readable if ep.resolved_at is None]
    return sorted(found, key=lambda ep: ep.opened_at)


def strongest(episodes: Iterable[Episode]) -> Episode | None:
    """The open episode that leads a node's reason (SEVERITY_RANK, then the oldest)."""
    return min(
        episodes,
        key=lambda ep: (SEVERITY_RANK.get(ep.severity, len(SEVERITY_RANK)), ep.opened_at),
        default=None,
    )


def node_reason(record: NodeRecord, episodes: Iterable[Episode]) -> str:
    """The reason people see for a node's state: its `why`, led by the strongest fault
    open on the node (with its GPUs and severity) where the state came from another."""
    top = strongest(ep for ep in episodes if ep.node == record.node)
    if top is None or top.rule == record.rule:
        return record.why
    lead = f"{fault_name(top.rule, top.gpus)} ({top.severity})"
    return f"{lead}; also {record.why}" if record.why else lead
