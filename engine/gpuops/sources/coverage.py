"""Which rules cannot fire when a source other than the agent feeds the engine.

A condition that reads a null field is false (gpuops/match/expr.py), so a rule reading a
field the source never fills never fires; nor does a rule on a kind the source never
sends. A rule whose `absent` waits for such a kind is worse: it fires on every node.
Drift, unreachable, ChatOps and Alertmanager events come from gpuops's own checks, from
people and from Alertmanager, whatever feeds the telemetry, so their rules are not the
source's concern.
"""

from __future__ import annotations

import ast
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from gpuops.match.expr import parse_condition
from gpuops.match.rules import Rule, RuleSet
from gpuops.models import DERIVED_FROM
from gpuops.sources import dcgm

Level = Literal["cannot-fire", "fires-everywhere", "needs-counters"]
SOURCES = ("dcgm",)
# Fields every fact has, whatever the source.
_ALWAYS = frozenset({"node", "gpu"})


@dataclass(frozen=True, slots=True)
class Gap:
    """One rule the source does not serve, and why."""

    rule: str
    file: str
    line: int
    level: Level
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: rule {self.rule}: {self.level}: {self.message}"


# What the built-in rules (gpuops/match/builtin.py) lose without an agent.
NOTES = {
    "dcgm": (
        "built-in rule validation-passed waits for the agent's probe: without an agent, a "
        "rebooted or reset node stays in validating until safety.validation_timeout_s, then "
        "goes to a person (or return it with `gpuops undrain`)",
    ),
}


def rule_fields(rule: Rule) -> frozenset[str]:
    """The fact fields a rule reads: names in `when` (not the functions) and `increase`."""
    names: set[str] = set()
    if rule.when:
        tree = parse_condition(rule.when)
        called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and id(n) not in called}
    if rule.increase is not None:
        names.add(rule.increase.field)
    # A fact the matcher derives is served where the field it comes from is.
    return frozenset(DERIVED_FROM.get(n, n) for n in names - _ALWAYS)


def gaps(rules: RuleSet, source: str = "dcgm") -> list[Gap]:
    """Every enabled rule the source cannot serve fully, in file order."""
    if source not in SOURCES:
        raise ValueError(f"unknown source {source!r}: one of {', '.join(SOURCES)}")
    out = []
    for rule in rules.rules:
        gap = _gap(rule) if rule.enabled else None
        if gap is not None:
            out.append(Gap(rule.name, rule.file, rule.line, *gap))
    return out


def _gap(rule: Rule) -> tuple[Level, str] | None:
    if rule.on in dcgm.INDEPENDENT_KINDS:
        return None
    if rule.on not in dcgm.KINDS:
        if rule.absent_s is not None:
            return "fires-everywhere", (
                f"its `absent` waits for {rule.on} events, which dcgm-exporter never sends, so "
                "it fires on every node: disable it (enabled: false) where no agent runs"
            )
        return "cannot-fire", f"dcgm-exporter never sends {rule.on} events"
    if rule.on != "telemetry":
        return None
    fields = rule_fields(rule)
    never = sorted(fields - dcgm.filled_fields())
    if never:
        return "cannot-fire", f"reads {', '.join(never)}, which the DCGM mapping never fills"
    extra = sorted(fields - dcgm.default_fields())
    if extra:
        metrics = [m.metrics[0] for m in dcgm.MAPPING if m.field in extra]
        return "needs-counters", (
            f"reads {', '.join(extra)}: add {', '.join(metrics)} to dcgm-exporter's counters "
            "CSV (its default-counters.csv leaves them out, and the rule cannot fire without)"
        )
    return None


@dataclass(frozen=True, slots=True)
class Unserved:
    """A rule that reads telemetry fields a feed did not publish: it cannot fire there."""

    rule: str
    file: str
    line: int
    fields: tuple[str, ...]

    @property
    def metrics(self) -> tuple[str, ...]:
        """The DCGM fields that would fill them (the first the mapping reads)."""
        return tuple(m.metrics[0] for m in dcgm.MAPPING if m.field in self.fields)

    def __str__(self) -> str:
        fields = ", ".join(self.fields)
        where = f"rule {self.rule} ({self.file}:{self.line}) reads {fields}"
        if not self.metrics:
            return f"{where}, which no DCGM field gives: the rule cannot fire on this feed"
        return (
            f"{where}, which this feed does not publish, so the rule cannot fire: add "
            f"{', '.join(self.metrics)} to dcgm-exporter's counters CSV (-f / "
            "DCGM_EXPORTER_COLLECTORS)"
        )


def fields_seen(events: Iterable[dict[str, Any]]) -> frozenset[str]:
    """The GpuSample fields the telemetry events carry on at least one GPU."""
    seen: set[str] = set()
    for event in events:
        if event.get("kind") == "telemetry":
            for gpu in event.get("data", {}).get("gpus", ()):
                seen.update(k for k, v in gpu.items() if v is not None)
    return frozenset(seen)


def unserved(rules: RuleSet, seen: Collection[str]) -> list[Unserved]:
    """Enabled telemetry rules reading a field no GPU of a feed carried (`seen`, e.g.
    `fields_seen` of a scrape or of recorded events), in file order."""
    out = []
    for rule in rules.rules:
        if not rule.enabled or rule.on != "telemetry":
            continue
        lacking = tuple(sorted(rule_fields(rule) - set(seen) - _ALWAYS))
        if lacking:
            out.append(Unserved(rule.name, rule.file, rule.line, lacking))
    return out
