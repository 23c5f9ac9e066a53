"""What a scrape that answered did not give, told once: a target that placed nothing, and
a rule that reads a field the feed never carried.

A page of another exporter, a selector matching nothing, a target that is no inventory
host or series without a usable `gpu` label all answer HTTP 200 and publish nothing; a
stock dcgm-exporter leaves out fields the shipped rules read (DCGM_FI_DEV_SLOWDOWN_TEMP,
which gpu-overheat compares with), and that rule then never fires. Either is a warning
naming the target or the rule and what to change, logged once while it lasts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuops.match.rules import RuleSet
from gpuops.sources.binding import UNKNOWN_TARGET, Refused, why
from gpuops.sources.coverage import Unserved, fields_seen, unserved

log = logging.getLogger(__name__)

# Drops that leave a node with no event, as a person reads them.
_DROPS = {
    "bad_gpu": "no usable `gpu` label (a GPU index)",
    "mig_instance": "MIG instances only (GPU_I_ID set), not whole GPUs",
    "not_finite": "NaN or infinite values",
    "out_of_range": "values past 2**64 in magnitude, more than any reading",
    "invalid": "values that are not a valid sample",
}


@dataclass(frozen=True, slots=True)
class Read:
    """One target's answer, as far as quiet targets care."""

    target: str
    query: bool  # a Prometheus server asked with a query (else a /metrics page)
    series: int  # mapped DCGM series parsed from it
    node: str | None  # a page's node (its URL's host in the inventory); None for a query


def quiet_targets(
    reads: Iterable[Read],
    refused: Iterable[Refused],
    dropped: Mapping[str, int],
    events: list[dict[str, Any]],
    node_label: str,
    selector: str = "",
) -> dict[str, str]:
    """Each target that answered and placed no series in an event, and why."""
    placed = {e["node"] for e in events}
    refusals = list(refused)
    out: dict[str, str] = {}
    for r in reads:
        if r.series == 0:
            out[r.target] = _nothing_matched(r, selector)
        elif (r.node not in placed) if not r.query else not placed:
            mine = [x for x in refusals if x.read == r.target]
            out[r.target] = _refused(mine[0], node_label) if mine else _dropped(dropped)
    return out


def _nothing_matched(r: Read, selector: str) -> str:
    if r.query:
        narrowed = f" with selector {selector!r}" if selector else ""
        return f"no series matched: the query for the DCGM fields{narrowed} found none"
    return (
        "no series matched: the page has none of the DCGM fields gpuops maps "
        "(is it dcgm-exporter's /metrics?)"
    )


def _refused(r: Refused, node_label: str) -> str:
    text = why(r)
    if r.reason == UNKNOWN_TARGET:
        claim = r.first.labels.get(node_label) if node_label else None
        if not claim:
            text += f"; its series carry no {node_label} label either"
        else:
            text += f"; its series say {node_label}={claim!r}"
        text += ": add the target's host (or its address as ansible_host) to the inventory"
    return text


def _dropped(dropped: Mapping[str, int]) -> str:
    parts = [f"{n} with {_DROPS.get(k, k)}" for k, n in sorted(dropped.items()) if n]
    return "every series was dropped: " + ("; ".join(parts) or "none was usable")


class Told:
    """What has been said already: a quiet target once while it stays quiet, an unserved
    rule once per process (a feed's counters change only when its exporter restarts)."""

    def __init__(self, rules: RuleSet | None = None) -> None:
        self.rules = rules
        self.quiet: dict[str, str] = {}
        self.unserved: set[tuple[str, tuple[str, ...]]] = set()

    def scrape(self, quiet: dict[str, str], events: list[dict[str, Any]]) -> list[str]:
        """Log what this scrape shows that was not said yet; the lines logged."""
        lines = [
            f"scrape {target}: {reason} (logged once while it lasts)"
            for target, reason in quiet.items()
            if self.quiet.get(target) != reason
        ]
        self.quiet = dict(quiet)
        lines += [f"dcgm feed: {u}" for u in self._unserved(events)]
        for line in lines:
            log.warning("%s", line)
        return lines

    def _unserved(self, events: list[dict[str, Any]]) -> list[Unserved]:
        if self.rules is None or not any(e["kind"] == "telemetry" for e in events):
            return []
        new = [
            u
            for u in unserved(self.rules, fields_seen(events))
            if (u.rule, u.fields) not in self.unserved
        ]
        self.unserved.update((u.rule, u.fields) for u in new)
        return new
