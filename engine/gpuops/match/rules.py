"""Typed rules: what a rule file says, after the schema and the semantic checks."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import Any

from gpuops.match.aggregates import Aggregate
from gpuops.match.expr import Condition


@dataclass(frozen=True, slots=True)
class RuleAction:
    """A playbook to run or a notification to send when the rule fires."""

    playbook: str | None = None
    ref: str | None = None
    vars: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 600.0
    notify: str | None = None


@dataclass(frozen=True, slots=True)
class Rung:
    """One step of a remediation ladder: a playbook, or handing the node to a person."""

    playbook: str | None = None
    vars: dict[str, Any] = field(default_factory=dict)
    approval: bool = False
    needs_human: bool = False
    timeout_s: float = 600.0
    gate: int = 0  # the gate's grade after this rung (0: the rule's)


@dataclass(frozen=True, slots=True)
class DomainRule:
    """`domain:` of a rule: the fault on `nodes` or more nodes of one domain of `kind`
    within `within_s` is the domain's. Each node's fault waits `within_s` for the others;
    the domain's episode holds the node remediations `hold_s` (its recovery) while its
    response runs: a power budget of `power_share` of the domain's policy limits, and
    people told."""

    kind: str
    nodes: int
    within_s: float
    hold_s: float
    power_share: float | None = None


@dataclass(frozen=True, slots=True)
class Ladder:
    """Rungs tried in order as a fault recurs on a node within `window_s`."""

    name: str
    window_s: float
    rungs: tuple[Rung, ...]
    file: str = ""
    line: int = 0


@dataclass(frozen=True, slots=True)
class Increase:
    """`increase: {field, by, within}`: a counter rose by at least `by` inside the window."""

    field: str
    by: float
    within_s: float


@dataclass(frozen=True, slots=True)
class Rule:
    """One rule, with its condition compiled and its durations in seconds."""

    name: str
    on: str
    file: str
    line: int
    description: str = ""
    group_by: tuple[str, ...] = ("node",)
    when: str | None = None
    condition: Condition | None = None
    expr: ast.expr | None = None  # the vetted condition, for the matcher's generated code
    aggregates: tuple[Aggregate, ...] = ()  # window and group functions the condition calls
    # Inventory host variables the rule reads (in `when` or `group_by`): the matcher adds
    # them to each fact from the inventory, so `budget_w` or `rack` read like fields.
    inventory_vars: tuple[str, ...] = ()
    for_s: float | None = None
    max_gap_s: float = 30.0
    count: int | None = None
    within_s: float | None = None
    absent_s: float | None = None
    increase: Increase | None = None
    severity: str = "warning"
    cooldown_s: float = 0.0
    # A per-GPU rule's matches on one node and one event become one match listing the
    # GPUs, so the node gets one action (one attempt, one cooldown, one breaker entry).
    consolidate: bool = False
    dry_run: bool = False
    enabled: bool = True
    approval: bool = False
    ladder: Ladder | None = None
    ladder_name: str | None = None
    actions: tuple[RuleAction, ...] = ()
    # The grade of diagnostics the gate back into service runs after this rule's fix
    # (at least safety.validation_grade): the deeper check a fault of its kind needs.
    gate: int = 0
    domain: DomainRule | None = None  # faults of many nodes of one domain: the domain's
    # Built-in rules only (gpuops/match/builtin.py):
    states: tuple[str, ...] = ()  # node states the rule applies in
    escalate: bool = False  # firing hands the node to a person (needs_human)
    by_person: bool = False  # a person asked (ChatOps): no silence, cooldown, ladder or cap
    climbs: bool = False  # a failed gate: decided as its fault again, under the fault's rule
    setting: bool = False  # keeps a setting (the power controller), not counted as a fix

    @property
    def per_member(self) -> bool:
        """Its key is one member: a GPU for telemetry, a node for other kinds."""
        keys = set(self.group_by)
        return "node" in keys and (self.on != "telemetry" or "gpu" in keys)

    @property
    def needs_inventory(self) -> bool:
        """Its key or condition reads the inventory (a host variable or a group)."""
        return bool(self.inventory_vars) or any(k.startswith("group:") for k in self.group_by)

    @property
    def span_s(self) -> float:
        """How far back the rule's answer depends on events: the longest of its window,
        its count window, its silence, its increase window and its aggregate windows."""
        spans = [
            (self.for_s or 0.0) + (self.max_gap_s if self.for_s is not None else 0.0),
            self.within_s or 0.0,
            self.absent_s or 0.0,
            self.increase.within_s if self.increase is not None else 0.0,
            *(a.window_s or 0.0 for a in self.aggregates),
        ]
        return max(spans)

    @property
    def temporal(self) -> str:
        """Which temporal form the rule uses: instant, for, count, absent or increase."""
        if self.for_s is not None:
            return "for"
        if self.count is not None:
            return "count"
        if self.absent_s is not None:
            return "absent"
        if self.increase is not None:
            return "increase"
        return "instant"


@dataclass(frozen=True, slots=True)
class RuleSet:
    """A loaded, valid set of rules indexed by event kind."""

    rules: tuple[Rule, ...]
    sources: tuple[str, ...] = ()
    ladders: tuple[Ladder, ...] = ()

    def by_kind(self) -> dict[str, list[Rule]]:
        """Enabled rules grouped by the event kind they match."""
        out: dict[str, list[Rule]] = {}
        for rule in self.rules:
            if rule.enabled:
                out.setdefault(rule.on, []).append(rule)
        return out

    def get(self, name: str) -> Rule | None:
        """The rule called `name`, if loaded."""
        return next((r for r in self.rules if r.name == name), None)
