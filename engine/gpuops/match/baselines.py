"""Fleet-relative baselines: a node's HBM bandwidth against its peers' under the same load.

A fixed threshold passes a node that is merely slow: 70% of what its twins move is no
alarm anywhere, yet it is the node that stretches every step of a data-parallel job.
So each telemetry sample of a node adds two facts to each of its GPUs:

    node_dram_bw_util           the node's mean DRAM bandwidth utilisation (GPM, %)
    dram_bw_util_fleet_median   the median of the other nodes' means, among nodes of the
                                same GPU model (`name`) in the same load band (their mean
                                `sm_active`, in bands of BAND points), each node's
                                latest reading no older than MAX_AGE_S

so a rule compares like with like (rules/baselines.yml). Fewer than MIN_PEERS such
nodes give no median (null: the condition is false). The medians are recomputed at most
every REFRESH_S of the events' time per band, so a sample costs a dict update, not a
sort of the fleet; state is one number per node (bounded by the inventory). The engine
keeps it per matcher: a replica sees the nodes of its own partitions, a sample of the
fleet large enough for a median.

The grades are baselined the same way (GradeBaseline): a `diagnostics` event's measured
numbers (NCCL busbw, nvbandwidth's lowest cells: GradeResult.measures) get the median of
the other nodes' latest passing results of the same SKU (the inventory's `gpu_sku`)
within GRADE_MAX_AGE_S, as `<measure>_fleet_median`: a node that passes its SKU's bound
at 70% of what its twins reach is caught where the bound alone passes it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from math import fsum
from typing import Any

from gpuops.match.facts import median_skipping

BAND = 10.0  # sm_active points per load band
MIN_PEERS = 5
REFRESH_S = 5.0
MAX_AGE_S = 120.0
FIELDS = ("node_dram_bw_util", "dram_bw_util_fleet_median")
# A grade runs after a remediation or on a rule's word, not every second: a node's last
# passing result stands for it this long (a month covers a fleet's periodic deep checks).
GRADE_MAX_AGE_S = 30 * 86400.0
GRADE_MEASURES = ("busbw_gbs", "d2d_gbs", "h2d_gbs")  # diagnose.results.MEASURES
GRADE_FIELDS = tuple(f"{m}_fleet_median" for m in GRADE_MEASURES)


@dataclass
class _Latest:
    """The latest value of every node of one peer group, and the median of the others."""

    max_age_s: float
    latest: dict[str, tuple[float, float]] = field(default_factory=dict)  # node -> (t, value)
    used: dict[str, float] = field(default_factory=dict)  # node -> its value as of `at`
    at: float = float("-inf")
    # What `median` answers until the next refresh (`_refresh`).
    picks: _Picks = field(default_factory=lambda: _NO_PICKS)

    def median(self, node: str, t: float, gone: Callable[[str], object]) -> float | None:
        """The median of the other nodes' values (None with fewer than MIN_PEERS), the
        values as of the last refresh, at most every REFRESH_S of event time; `gone`
        hears of each node dropped for age."""
        if t - self.at >= REFRESH_S or t < self.at:
            self._refresh(t, gone)
        own = self.used.get(node)
        low, high, before, middle, after, everyone = self.picks
        if own is None:
            return everyone
        return before if own <= low else middle if own <= high else after

    def _refresh(self, t: float, gone: Callable[[str], object]) -> None:
        """Take the fresh values, and work out the medians every node gets till the next:
        the others' median (the node is not its own peer: one copy of its value left out)
        is the same for every node whose value lies before the middle of the sorted values
        (at most `low`), and for every one after it (above `high`), as in with_medians."""
        fresh = {n: v for n, (seen, v) in self.latest.items() if t - seen <= self.max_age_s}
        for old in self.latest.keys() - fresh.keys():
            del self.latest[old]
            gone(old)
        self.used, self.at = fresh, t
        ordered = sorted(fresh.values())
        n = len(ordered)
        everyone = _rounded(median_skipping(ordered, n, MIN_PEERS))
        if not n:
            self.picks = (*_NO_PICKS[:5], everyone)
            return
        mid = (n - 1) // 2
        self.picks = (
            ordered[mid - 1] if mid else -math.inf,
            ordered[mid],
            _rounded(median_skipping(ordered, 0, MIN_PEERS)),
            _rounded(median_skipping(ordered, mid, MIN_PEERS)),
            _rounded(median_skipping(ordered, n - 1, MIN_PEERS)),
            everyone,
        )


# (low, high, before, middle, after, everyone): a node's value at most low gets before,
# at most high middle, above it after; a node without a value everyone.
_Picks = tuple[float, float, float | None, float | None, float | None, float | None]
_NO_PICKS: _Picks = (math.inf, math.inf, None, None, None, None)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


class FleetBaseline:
    """The latest mean bandwidth of every node, by GPU model and load band."""

    def __init__(self) -> None:
        self._bands: dict[tuple[str, int], _Latest] = {}
        self._band_of: dict[str, tuple[str, int]] = {}

    def observe(self, node: str, facts: list[dict[str, Any]], t: float) -> None:
        """Add the node's reading and give each of its GPU facts the two baseline facts."""
        bandwidth = [v for f in facts if (v := f.get("dram_bw_util")) is not None]
        active = [v for f in facts if (v := f.get("sm_active")) is not None]
        if not bandwidth or not active:
            for fact in facts:
                fact.update(dict.fromkeys(FIELDS))
            return
        mine = fsum(bandwidth) / len(bandwidth)  # statistics.fmean, without its checks
        key = (str(facts[0].get("name") or ""), int(fsum(active) / len(active) // BAND))
        moved_from = self._band_of.get(node)
        if moved_from is not None and moved_from != key:
            self._bands[moved_from].latest.pop(node, None)
        band = self._bands.get(key)
        if band is None:  # not setdefault: a band made for nothing every sample
            band = self._bands[key] = _Latest(MAX_AGE_S)
        band.latest[node] = (t, mine)
        self._band_of[node] = key
        median = band.median(node, t, self._gone)
        shown = round(mine, 2)
        for fact in facts:
            fact["node_dram_bw_util"] = shown
            fact["dram_bw_util_fleet_median"] = median

    def _gone(self, node: str) -> None:
        """A node aged out of its band."""
        self._band_of.pop(node, None)


class GradeBaseline:
    """Each node's latest passing grade numbers, by SKU (`sku_of(node)`), and the median
    of the other nodes' for each `diagnostics` event. State: three numbers per node."""

    def __init__(self, sku_of: Callable[[str], str]) -> None:
        self.sku_of = sku_of
        self._groups: dict[tuple[str, str], _Latest] = {}

    def observe(self, node: str, fact: dict[str, Any], t: float) -> None:
        """Learn the event's numbers (a passing run's only: a failed one is acted on as a
        fault, not a peer) and give the fact each measure's fleet median."""
        sku = self.sku_of(node)
        for measure, median_field in zip(GRADE_MEASURES, GRADE_FIELDS, strict=True):
            group = self._groups.get((sku, measure))
            value = fact.get(measure)
            if value is not None and fact.get("ok"):
                if group is None:
                    group = self._groups[(sku, measure)] = _Latest(GRADE_MAX_AGE_S)
                group.latest[node] = (t, float(value))
            fact[median_field] = None if group is None else group.median(node, t, _kept)


def _kept(node: str) -> None:
    """A node aged out of a grade's group: nothing else holds it."""
