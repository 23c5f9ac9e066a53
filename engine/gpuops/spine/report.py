"""What `gpuops replay` tells of a recording: every decision, by what it amounts to.

Actions are listed one by one (each is a run the engine would have started). Drops and
escalations are folded per (rule, node, reason) into one line with a count and the first
and last time, as the live audit folds a held rule's repeats: a node past its attempt cap
for two hours is one `needs-human` line, not one per sample. Breaker trips are listed
with when and why, events refused at intake by reason (and node, where one could be
read), and events about hosts outside the inventory by host.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from gpuops.clock import rfc3339
from gpuops.decide.breaker import BreakerRecord, BreakerState
from gpuops.models import Decision, Reason
from gpuops.spine.shadow import ESCALATES, WOULD, WouldRun, would_run

Row = dict[str, object]


@dataclass(frozen=True, slots=True)
class Fold:
    """Identical drops of one rule on one node: how many, the first and last event time."""

    rule: str
    node: str
    reason: Reason
    detail: str  # the first one's
    count: int
    first: float
    last: float
    gpu: int | None = None
    gpus: tuple[int, ...] = ()

    @property
    def kind(self) -> str:
        """`escalation` for a drop that hands the node to a person, else `drop`."""
        return "escalation" if self.reason in ESCALATES else "drop"

    def as_dict(self) -> Row:
        """The `--json` line."""
        return {
            "kind": self.kind,
            "rule": self.rule,
            "node": self.node,
            "gpu": self.gpu,
            "gpus": list(self.gpus),
            "reason": self.reason.value,
            "detail": self.detail,
            "count": self.count,
            "first": rfc3339(self.first),
            "last": rfc3339(self.last),
        }


@dataclass(frozen=True, slots=True)
class Trip:
    """The fleet breaker opened: when (the replay's clock) and why."""

    at: float
    why: str

    def as_dict(self) -> Row:
        """The `--json` line."""
        return {"kind": "trip", "at": rfc3339(self.at), "why": self.why}


@dataclass(frozen=True, slots=True)
class Refusal:
    """Lines the intake refused for one reason (and node, where it could be read)."""

    reason: str
    node: str
    error: str  # the first one's
    count: int
    first_line: int
    last_line: int

    def as_dict(self) -> Row:
        """The `--json` line."""
        return {
            "kind": "refused",
            "reason": self.reason,
            "node": self.node,
            "error": self.error,
            "count": self.count,
            "first_line": self.first_line,
            "last_line": self.last_line,
        }


@dataclass
class Report:
    """Everything one replay decided, refused and noticed."""

    actions: list[WouldRun] = field(default_factory=list)
    folds: dict[tuple[str, str, Reason], Fold] = field(default_factory=dict)
    by_reason: Counter[tuple[str, Reason]] = field(default_factory=Counter)
    trips: list[Trip] = field(default_factory=list)
    refused: dict[tuple[str, str], Refusal] = field(default_factory=dict)
    unknown: Counter[str] = field(default_factory=Counter)  # host -> events about it
    # A person's command (a silence, a power budget) the replay could not carry out as
    # the live engine did -> times: what follows it may differ from live.
    unapplied: Counter[str] = field(default_factory=Counter)
    events: int = 0  # events fed to the engine (those about unknown hosts too)

    def decided(self, decisions: list[Decision]) -> None:
        """Take in the decisions of one step."""
        for d in decisions:
            self.by_reason[d.match.rule, d.reason] += 1
            if d.reason in WOULD:
                self.actions += would_run(d)
            else:
                self._fold(d)

    def _fold(self, d: Decision) -> None:
        m = d.match
        key = (m.rule, m.node, d.reason)
        was = self.folds.get(key)
        if was is None:
            t = m.event_ts
            self.folds[key] = Fold(m.rule, m.node, d.reason, d.detail, 1, t, t, m.gpu, m.gpus)
        else:
            self.folds[key] = replace(was, count=was.count + 1, last=max(was.last, m.event_ts))

    def breaker(self, record: BreakerRecord) -> None:
        """The breaker as it is after a step: a trip not seen yet is listed."""
        opened = record.state is BreakerState.OPEN
        if opened and (not self.trips or self.trips[-1].at != record.since):
            self.trips.append(Trip(record.since, record.why))

    def refuse(self, line: int, reason: str, error: str, node: str = "") -> None:
        """A line the intake would have dead-lettered."""
        was = self.refused.get((reason, node))
        if was is None:
            self.refused[reason, node] = Refusal(reason, node, error, 1, line, line)
        else:
            self.refused[reason, node] = replace(was, count=was.count + 1, last_line=line)

    @property
    def escalations(self) -> list[Fold]:
        """The folds that hand a node to a person, by first time."""
        return [f for f in self.drops(every=True) if f.kind == "escalation"]

    def drops(self, every: bool = False) -> list[Fold]:
        """The folded drops by first time (`every`: escalations too)."""
        folds = sorted(self.folds.values(), key=lambda f: (f.first, f.rule, f.node))
        return [f for f in folds if every or f.kind == "drop"]

    def refusals(self, reason: str | None = None) -> int:
        """Lines refused at intake (for `reason`; None: for any)."""
        return sum(r.count for r in self.refused.values() if reason in (None, r.reason))

    def lines(self) -> list[Row]:
        """The `--json` lines: actions in event order, then escalations, drops, trips,
        refusals, unknown hosts, and a summary."""
        rows: list[Row] = [{"kind": "action", **a.as_dict()} for a in self.actions]
        rows += [f.as_dict() for f in self.drops(every=True)]
        rows += [t.as_dict() for t in self.trips]
        rows += [r.as_dict() for r in self.refused.values()]
        rows += [{"kind": "unknown_node", "node": n, "events": c} for n, c in self.unknown.items()]
        rows += [{"kind": "unapplied", "command": c, "times": n} for c, n in self.unapplied.items()]
        rows.append({"kind": "summary", **self.summary()})
        return rows

    def summary(self) -> dict[str, int]:
        """Counts of everything above."""
        return {
            "events": self.events,
            "unreadable": self.refusals() - self.refusals("future"),
            "future": self.refusals("future"),
            "actions": len(self.actions),
            "escalations": len(self.escalations),
            "drops": sum(f.count for f in self.drops()),
            "trips": len(self.trips),
            "unknown_nodes": len(self.unknown),
            "unapplied": sum(self.unapplied.values()),
        }
