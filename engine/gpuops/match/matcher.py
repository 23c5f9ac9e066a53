"""The match stage: events in, Matches out. Rules are indexed by event kind.

The hot path is `_eval`: per fact and rule, one compiled condition call and, for
rules with a temporal form, one dict lookup in that rule's window.

There is no matcher-wide notion of "the current event time": every key's windows
run on that key's own events, and eviction compares each key's newest time with the
engine's clock. One event (a future-dated one from an unknown host, say) can only
ever move its own key.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from pathlib import Path
from typing import Any

from gpuops.clock import Clock
from gpuops.inventory.hosts import Inventory
from gpuops.match.aggregates import Aggregates
from gpuops.match.baselines import FIELDS, GRADE_FIELDS, FleetBaseline, GradeBaseline
from gpuops.match.codegen import (
    Cleared,
    Entry,
    KindEval,
    Quiet,
    compile_kind,
    node_gpu_key,
    node_key,
)
from gpuops.match.expr import fact_keys
from gpuops.match.facts import Fact, Telemetry, facts_of
from gpuops.match.facts import peer_median as peer_median  # where callers found it
from gpuops.match.rules import Rule, RuleSet
from gpuops.match.windows import Absent, CountWithin, HeldFor, Increase, Instant, Window
from gpuops.models import QUIET_FIELDS, STATEFUL_KINDS, Event, Match

# How long state outlives its window, by the clock. After an outage the engine reads a
# backlog of samples minutes old; their runs must go on, so eviction waits as long as
# the telemetry stream keeps samples (its max age).
SWEEP_GRACE_S = 600.0


Tables = Mapping[str, Mapping[str, Hashable]]  # group key name -> node -> its value


def _key_fn(
    group_by: tuple[str, ...], tables: Tables | None = None
) -> Callable[[Mapping[str, Any]], Hashable]:
    if tables:
        return _inventory_key_fn(group_by, tables)
    if group_by == ("fleet",):
        return lambda f: "fleet"
    if group_by == ("node",):
        return node_key  # the generated code inlines these two
    if group_by == ("node", "gpu") or group_by == ("gpu", "node"):
        return node_gpu_key
    return lambda f: tuple(f.get(k) for k in group_by)


def _inventory_key_fn(
    group_by: tuple[str, ...], tables: Tables
) -> Callable[[Mapping[str, Any]], Hashable]:
    """A key with parts from the inventory; None (no group) when the node lacks one."""
    parts = [(k, tables.get(k)) for k in group_by]

    def key(f: Mapping[str, Any]) -> Hashable:
        node, out = str(f.get("node")), []
        for name, table in parts:
            value = (
                table.get(node)
                if table is not None
                else ("fleet" if name == "fleet" else f.get(name))
            )
            if value is None:
                return None
            out.append(value)
        return out[0] if len(out) == 1 else tuple(out)

    return key


def inventory_tables(names: Iterable[str], inventory: Inventory) -> dict[str, dict[str, Hashable]]:
    """Node -> value for each inventory group key: a host variable, or `group:PARENT`.

    A `group:PARENT` key is the child group of PARENT that holds the node (the first by
    name if the loader let two through); a value that is not text or a number is keyed
    by its text, so any variable can group.
    """
    out: dict[str, dict[str, Hashable]] = {}
    for name in names:
        table: dict[str, Hashable] = {}
        if name.startswith("group:"):
            for child in sorted(
                inventory.children.get(name.removeprefix("group:"), ()), reverse=True
            ):
                table.update(dict.fromkeys(inventory.group_hosts(child), child))
        else:
            for node, hv in inventory.hostvars.items():
                if hv.get(name) is not None:
                    v = hv[name]
                    table[node] = v if isinstance(v, str | int | float) else str(v)
        out[name] = table
    return out


def key_text(key: Hashable) -> str:
    """A group key as text for records: `node-001/3`, `node-001`, `fleet`."""
    if isinstance(key, tuple):
        return "/".join("-" if k is None else str(k) for k in key)
    return str(key)


def _window(rule: Rule, clock: Clock | None) -> Window:
    if rule.for_s is not None:
        return HeldFor(rule.for_s, rule.max_gap_s)
    if rule.count is not None and rule.within_s is not None:
        return CountWithin(rule.count, rule.within_s)
    if rule.absent_s is not None:
        return Absent(rule.absent_s, clock)
    if rule.increase is not None:
        return Increase(rule.increase.by, rule.increase.within_s)
    return Instant()


class Matcher:
    """Evaluates events against a rule set, keeping each rule's window state."""

    def __init__(
        self,
        rules: RuleSet,
        clock: Clock | None = None,
        sweep_grace_s: float = SWEEP_GRACE_S,
        inventory: Inventory | None = None,
        quiet_fields: frozenset[str] = QUIET_FIELDS,
    ) -> None:
        """`quiet_fields`: the telemetry fields that change on events (frozenset() makes
        every rule look at every sample; the tests compare both)."""
        self.inventory = inventory
        self.quiet_fields = quiet_fields
        self._by_kind: dict[str, list[Entry]] = {}
        self._eval_kind: dict[str, KindEval] = {}
        self._per_node: frozenset[str] = frozenset()
        self._cleared: list[Cleared] = []
        self.clock = clock
        self.sweep_grace_s = sweep_grace_s
        self.rules = rules
        self.baseline: FleetBaseline | None = None
        self.grades: GradeBaseline | None = None
        self.replace(rules)

    def replace(self, rules: RuleSet) -> None:
        """Swap in a new rule set; rules whose definition did not change keep their state."""
        old = {c.rule.name: c for cs in self._by_kind.values() for c in cs}
        by_kind: dict[str, list[Entry]] = {}
        for kind, kind_rules in rules.by_kind().items():
            compiled = []
            for rule in kind_rules:
                prev = old.get(rule.name)
                keep = prev is not None and _same_definition(prev.rule, rule)
                window = prev.window if keep and prev is not None else _window(rule, self.clock)
                field = rule.increase.field if rule.increase else None
                # Telemetry conditions are states: their first false sample ends an episode;
                # so does an alert's resolution (its condition names the status).
                watched = kind in STATEFUL_KINDS and rule.expr is not None
                fired = (prev.fired if keep and prev else None) or (set() if watched else None)
                agg = prev.agg if keep and prev is not None else _aggregates(rule)
                tables, extra = self._inventory_of(rule)
                key = _key_fn(rule.group_by, tables)
                alert = kind == "alert"
                compiled.append(Entry(rule, window, key, field, fired, agg, extra, alert))
            by_kind[kind] = compiled
        # What the last rule set remembered of quiet GPUs is not this one's.
        self._quiet = Quiet(self.quiet_fields, {})
        self._eval_kind = {
            kind: compile_kind(
                cs, _match, kind, self._cleared, self._quiet if kind == "telemetry" else None
            )
            for kind, cs in by_kind.items()
        }
        self._by_kind = by_kind
        self._per_node = frozenset(r.name for r in rules.rules if r.consolidate)
        # The fleet baseline costs a dict update a sample: kept only while a rule reads it
        # (a reload that keeps such a rule keeps what it has learnt).
        reads = any(set(FIELDS) & fact_keys(r.expr) for r in rules.rules if r.on == "telemetry")
        self.baseline = (self.baseline or FleetBaseline()) if reads else None
        graded = any(
            set(GRADE_FIELDS) & fact_keys(r.expr) for r in rules.rules if r.on == "diagnostics"
        )
        self.grades = (self.grades or GradeBaseline(self._sku_of)) if graded else None
        self.rules = rules

    def _sku_of(self, node: str) -> str:
        """The node's SKU as the diagnose playbook reads it (host variable `gpu_sku`)."""
        hostvars = self.inventory.hostvars.get(node, {}) if self.inventory else {}
        return str(hostvars.get("gpu_sku") or "")

    def set_inventory(self, inventory: Inventory) -> None:
        """Group keys and inventory facts from a new inventory; windows and aggregates stay.

        A node that moved (another rack) is keyed by its new group from its next sample;
        what the old group held of it ages out like any member that stopped reporting.
        """
        self.inventory = inventory
        self.replace(self.rules)

    def _inventory_of(
        self, rule: Rule
    ) -> tuple[dict[str, dict[str, Hashable]] | None, dict[str, dict[str, Any]] | None]:
        """The rule's group key tables and each node's variables it reads (None: neither)."""
        if not rule.needs_inventory:
            return None, None
        inv = self.inventory or Inventory(Path("<none>"), frozenset(), {}, {})
        names = [k for k in rule.group_by if k.startswith("group:") or k in rule.inventory_vars]
        tables = inventory_tables(names, inv)
        wanted = rule.inventory_vars
        extra = {node: {v: hv[v] for v in wanted if v in hv} for node, hv in inv.hostvars.items()}
        return tables, extra

    def has_cleared(self) -> bool:
        """Whether some key went false since the last `take_cleared`."""
        return bool(self._cleared)

    def take_cleared(self) -> list[Cleared]:
        """Keys whose condition went false since the last call (rule, node, gpu, time)."""
        if not self._cleared:
            return []
        out = list(self._cleared)
        self._cleared.clear()
        return out

    def kinds(self) -> frozenset[str]:
        """Event kinds at least one rule listens to."""
        return frozenset(self._by_kind)

    def match(self, event: Event | Telemetry) -> list[Match]:
        """Every rule firing on this event (telemetry: on the facts it was decoded to)."""
        evaluate = self._eval_kind.get(event.kind)
        if evaluate is None:
            return []
        t, event_id = event.epoch, event.id
        out: list[Match] = []
        facts = facts_of(event)
        if self.baseline is not None and event.kind == "telemetry":
            self.baseline.observe(event.node, facts, t)
        elif self.grades is not None and event.kind == "diagnostics":
            self.grades.observe(event.node, facts[0], t)
        for fact in facts:
            evaluate(fact, t, event_id, out)
        return consolidated(out, self._per_node) if len(out) > 1 and self._per_node else out

    def match_facts(self, kind: str, facts: Iterable[Fact], t: float, event_id: str) -> list[Match]:
        """Evaluate pre-built facts (bench and replay fast path)."""
        evaluate = self._eval_kind.get(kind)
        out: list[Match] = []
        if evaluate is not None:
            if self.baseline is not None and kind == "telemetry":
                facts = list(facts)
                if facts:
                    self.baseline.observe(str(facts[0]["node"]), facts, t)
            elif self.grades is not None and kind == "diagnostics":
                facts = list(facts)
                for fact in facts:
                    self.grades.observe(str(fact["node"]), fact, t)
            for fact in facts:
                evaluate(fact, t, event_id, out)
        return consolidated(out, self._per_node) if len(out) > 1 and self._per_node else out

    def tick(self, now: float) -> list[Match]:
        """Matches that come from silence (`absent` rules), as of `now`."""
        out = []
        for compiled in self._by_kind.values():
            for c in compiled:
                if isinstance(c.window, Absent):
                    for key in c.window.due(now):
                        last = c.window.last[key]
                        fact = _fact_from_key(c.rule, key)
                        out.append(_match(c.rule, key, fact, now, f"absent:{key_text(key)}:{last}"))
        return out

    def warm(self, event: Event | Telemetry) -> None:
        """Feed an event another replica already decided: windows, runs and `fired`
        marks move as they did there, but nothing is matched again (a takeover)."""
        pending = list(self._cleared)
        self.match(event)
        self._cleared[:] = pending  # its clearings were settled by whoever decided it

    def span_s(self, kinds: Iterable[str]) -> float:
        """The longest window of the rules on these kinds (what a takeover replays)."""
        wanted = set(kinds)
        return max(
            (c.rule.span_s for k, cs in self._by_kind.items() if k in wanted for c in cs),
            default=0.0,
        )

    def forget(self, nodes: frozenset[str] | set[str]) -> int:
        """Drop the state keyed by these nodes (their partition went to another replica,
        whose windows are the ones that count now); returns how many keys went."""
        self._quiet.forget()  # not needed (less state only), but the nodes are gone here
        dropped = 0
        for c in (c for cs in self._by_kind.values() for c in cs):
            for held in (*_key_holders(c.window), *((c.fired,) if c.fired is not None else ())):
                gone = [k for k in held if _node_of(k) in nodes]
                for k in gone:
                    if isinstance(held, set):
                        held.discard(k)
                    else:
                        del held[k]
                dropped += len(gone)
        return dropped

    def seed(self, nodes: Iterable[str], now: float) -> None:
        """Expect every known node: an `absent` rule fires for one that never reports."""
        names = list(nodes)
        for compiled in self._by_kind.values():
            for c in compiled:
                if isinstance(c.window, Absent) and c.rule.group_by == ("node",):
                    for node in names:
                        c.window.seed(node, now)

    def sweep(self, now: float | None = None) -> int:
        """Evict state of keys whose own newest event is older than their window as of `now`.

        `now` is the engine's clock (the matcher's own clock when not given; with
        neither, nothing is evicted). Keys get `sweep_grace_s` more, for backlogs.
        """
        if now is None:
            if self.clock is None:
                return 0
            now = self.clock.now()
        at = now - self.sweep_grace_s
        self._quiet.trim()
        dropped = sum(c.window.sweep(at) for cs in self._by_kind.values() for c in cs)
        dropped += sum(c.agg.sweep(at) for cs in self._by_kind.values() for c in cs if c.agg)
        for c in (c for cs in self._by_kind.values() for c in cs):
            if c.fired and isinstance(c.window, HeldFor) and not c.alert:
                c.fired.intersection_update(c.window.state)  # a quiet key has no run to end
        return dropped

    def state_size(self) -> int:
        """Keys held across all windows (bounded by live keys)."""
        entries = [c for cs in self._by_kind.values() for c in cs]
        return sum(len(c.window) + (len(c.agg) if c.agg else 0) for c in entries)

    def aggregate_bytes(self) -> int:
        """Bytes the aggregate series hold (the bench's per-key figure)."""
        return sum(c.agg.nbytes() for cs in self._by_kind.values() for c in cs if c.agg)


def _key_holders(window: Window) -> list[Any]:
    """The dicts and sets of a window that are keyed by its group key."""
    names = ("state", "last", "rises", "fired")
    return [h for n in names if isinstance(h := getattr(window, n, None), dict | set)]


def _node_of(key: Hashable) -> object:
    """The node a group key starts with (a node, or a (node, gpu) pair; alert keys are
    (key, fingerprint))."""
    while isinstance(key, tuple) and key:
        key = key[0]
    return key


def consolidated(matches: list[Match], per_node: frozenset[str]) -> list[Match]:
    """One match per rule and node for rules that act once per node (`consolidate: node`).

    The merged match lists the GPUs in index order and carries the lowest GPU's facts
    (action vars are rendered from them), so eight GPUs with the same fault make one
    intent, one attempt and one cooldown, not eight.
    """
    merged: dict[tuple[str, str], Match] = {}
    out: list[Match] = []
    for m in matches:
        if m.rule not in per_node:
            out.append(m)
            continue
        first = merged.get((m.rule, m.node))
        if first is None:
            merged[(m.rule, m.node)] = m
            out.append(m)
            continue
        gpus = tuple(sorted({*first.gpus, *m.gpus}))
        both = first.model_copy(update={"gpu": None, "gpus": gpus})
        out[out.index(first)] = merged[(m.rule, m.node)] = both
    return out


def _aggregates(rule: Rule) -> Aggregates | None:
    if not rule.aggregates:
        return None
    return Aggregates(rule.aggregates, rule.per_member, rule.max_gap_s)


def _same_definition(a: Rule, b: Rule) -> bool:
    # max_gap is part of a `for` window and of a group aggregate's freshness.
    return (
        a.on,
        a.when,
        a.group_by,
        a.temporal,
        a.for_s,
        a.max_gap_s,
        a.count,
        a.within_s,
        a.absent_s,
    ) == (
        b.on,
        b.when,
        b.group_by,
        b.temporal,
        b.for_s,
        b.max_gap_s,
        b.count,
        b.within_s,
        b.absent_s,
    ) and a.increase == b.increase


def _fact_from_key(rule: Rule, key: Hashable) -> Fact:
    parts = key if isinstance(key, tuple) else (key,)
    return dict(zip(rule.group_by, parts, strict=False))


def _match(rule: Rule, key: Hashable, fact: Mapping[str, Any], t: float, event_id: str) -> Match:
    node = str(fact.get("node", ""))
    gpu = fact.get("gpu")
    one = gpu if isinstance(gpu, int) and not isinstance(gpu, bool) else None
    return Match(
        rule=rule.name,
        kind=rule.on,
        node=node,
        gpu=one,
        gpus=() if one is None else (one,),
        key=node if rule.consolidate else key_text(key),
        event_id=event_id,
        event_ts=t,
        at=t,
        severity=rule.severity,
        facts=dict(fact),
    )
