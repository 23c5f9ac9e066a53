"""Which node a scraped series speaks for: its scrape target's, found in the inventory.

An exporter writes its own labels: a compromised node's dcgm-exporter can put any host
name in `Hostname`, and an XID 79 there reboots that host. What it cannot choose is
where it was scraped: the `--target` URL gpuops reads, or the `instance` label (and any
label relabelling sets, `target_label`) that Prometheus attaches to each series of a
target; with `honor_labels: false`, Prometheus's default, an exposed label of the same
name is kept only as `exported_<name>`. So the node is the target's, looked up in the
inventory by host name or `ansible_host`, and the exporter's own host name label
(`node_label`) is only checked against it. A series claiming another node is refused as
`forged`, one from a target that is no inventory host as `unknown_target`: counted,
logged and dead-lettered once per target while it lasts, never published.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import yarl

from gpuops import subjects
from gpuops.agent.spool import Spooled
from gpuops.intake.decode import dead_letter
from gpuops.inventory.targets import Targets
from gpuops.sources.readings import Series, instance_host, kept_labels

log = logging.getLogger(__name__)

FORGED, UNKNOWN_TARGET = subjects.SOURCE_REFUSALS
INSTANCE = "instance"  # the label Prometheus sets to each target's address


@dataclass(slots=True)
class Refused:
    """One target's series refused in one scrape: for the count, the log and the letter."""

    read: str  # the URL read: the target itself, or the Prometheus server
    target: str  # the scrape target: the URL, or the series' `instance`
    reason: str
    node: str | None  # the target's node (None: it is none)
    claim: str | None  # what the exporter's own host name label said
    first: Series
    count: int = 0


@dataclass(slots=True)
class Bound:
    """Series placed under their target's node, and what was refused (target, reason)."""

    series: dict[str, list[Series]] = field(default_factory=dict)
    refused: dict[tuple[str, str], Refused] = field(default_factory=dict)

    def refuse(
        self, read: str, target: str, reason: str, node: str | None, claim: str | None, s: Series
    ) -> None:
        """Count `s` against its target and reason (the first one is kept as the example)."""
        r = self.refused.get((target, reason))
        if r is None:
            r = self.refused[(target, reason)] = Refused(read, target, reason, node, claim, s)
        r.count += 1


class Binding(Targets):
    """Scrape targets to inventory nodes, and whether an exporter's own claim agrees."""

    def node_of_url(self, url: str) -> str | None:
        """The node of a `--target` URL (dcgm-exporter read directly)."""
        return self.node_of(yarl.URL(url).host)

    def target_of(self, labels: dict[str, str]) -> tuple[str, str | None]:
        """A Prometheus series' target (`instance`) and its node: Prometheus's labels."""
        instance = labels.get(INSTANCE, "")
        if self.target_label is not None:
            return instance, self.node_of(labels.get(self.target_label))
        return instance, self.node_of(instance_host(instance))

    def _targets_of(self, series: list[Series]) -> list[tuple[str, str | None]]:
        """`target_of` for each series, looked up once per target (its series share it)."""
        label = self.target_label or INSTANCE
        known: dict[tuple[str | None, str | None], tuple[str, str | None]] = {}
        out = []
        for s in series:
            key = (s.labels.get(INSTANCE), s.labels.get(label))
            found = known.get(key)
            if found is None:
                found = known[key] = self.target_of(s.labels)
            out.append(found)
        return out

    def bind(self, read: str, query: bool, series: list[Series], out: Bound) -> None:
        """Each series under its target's node in `out`, or refused there with a reason."""
        if query:
            targets = self._targets_of(series)
        else:
            targets = [(read, self.node_of_url(read))] * len(series)
        label, by_node = self.node_label or None, out.series
        for s, (target, node) in zip(series, targets, strict=True):
            # The usual series, first and inline: 100,000 of them per scrape on a big fleet.
            claim = s.labels.get(label) if label else None
            if node is not None and (not claim or claim == node or self.agrees(node, s.labels)):
                kept = by_node.get(node)
                if kept is None:
                    kept = by_node[node] = []
                kept.append(s)
            elif node is None:
                out.refuse(read, target, UNKNOWN_TARGET, None, None, s)
            else:
                out.refuse(read, target, FORGED, node, claim, s)


class Refusals:
    """The (target, reason) pairs refused now: each is news once, when it starts."""

    def __init__(self) -> None:
        self.active: dict[tuple[str, str], str] = {}  # -> the URL it was read from

    def news(self, refused: dict[tuple[str, str], Refused], failed: Iterable[str]) -> list[Refused]:
        """The refusals not already under way, logged once each."""
        down = set(failed)
        new = [r for key, r in refused.items() if key not in self.active]
        # An answer that did not come says nothing about whether its targets stopped.
        kept = {key: read for key, read in self.active.items() if read in down}
        self.active = kept | {key: r.read for key, r in refused.items()}
        for r in new:
            log.warning("scrape %s: %s (logged once while it lasts)", r.target, why(r))
        return new


def why(r: Refused) -> str:
    """What a person reads: which target, which node, what the exporter claimed."""
    if r.reason == UNKNOWN_TARGET:
        return (
            f"{r.count} series refused: the target is no inventory host (by name or "
            "ansible_host, or by the target label Prometheus sets)"
        )
    return (
        f"{r.count} series refused as forged: the target is node {r.node}, its exporter "
        f"says {r.claim!r}"
    )


def letter(r: Refused, at: float) -> Spooled:
    """The dead letter of a refusal: the target, its node, the count and the first series."""
    value = r.first.value if math.isfinite(r.first.value) else str(r.first.value)
    first = {"name": r.first.name, "labels": kept_labels(r.first.labels), "value": value}
    detail = {"target": r.target, "node": r.node, "claim": r.claim, "series": r.count}
    payload = json.dumps({**detail, "first": first}, sort_keys=True).encode()
    body = dead_letter(r.reason, why(r), payload, f"scrape:{r.target}", at)
    digest = hashlib.sha256(f"{r.reason}|{r.target}|{at}".encode()).hexdigest()[:40]
    return Spooled(subjects.dlq(r.reason), body.decode(), f"dlq-src-{digest}")
