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
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

BAND = 10.0  # sm_active points per load band
MIN_PEERS = 5
REFRESH_S = 5.0
MAX_AGE_S = 120.0
FIELDS = ("node_dram_bw_util", "dram_bw_util_fleet_median")


@dataclass
class _Band:
    latest: dict[str, tuple[float, float]] = field(default_factory=dict)  # node -> (t, mean)
    ordered: list[float] = field(default_factory=list)  # the means, sorted, as of `at`
    used: dict[str, float] = field(default_factory=dict)  # node -> its mean in `ordered`
    at: float = float("-inf")


class FleetBaseline:
    """The latest mean bandwidth of every node, by GPU model and load band."""

    def __init__(self) -> None:
        self._bands: dict[tuple[str, int], _Band] = {}
        self._band_of: dict[str, tuple[str, int]] = {}

    def observe(self, node: str, facts: list[dict[str, Any]], t: float) -> None:
        """Add the node's reading and give each of its GPU facts the two baseline facts."""
        bandwidth = [f["dram_bw_util"] for f in facts if f.get("dram_bw_util") is not None]
        active = [f["sm_active"] for f in facts if f.get("sm_active") is not None]
        if not bandwidth or not active:
            for fact in facts:
                fact.update(dict.fromkeys(FIELDS))
            return
        mine = fmean(bandwidth)
        key = (str(facts[0].get("name") or ""), int(fmean(active) // BAND))
        moved_from = self._band_of.get(node)
        if moved_from is not None and moved_from != key:
            self._bands[moved_from].latest.pop(node, None)
        band = self._bands.setdefault(key, _Band())
        band.latest[node] = (t, mine)
        self._band_of[node] = key
        median = self._median(band, node, t)
        for fact in facts:
            fact["node_dram_bw_util"] = round(mine, 2)
            fact["dram_bw_util_fleet_median"] = median

    def _median(self, band: _Band, node: str, t: float) -> float | None:
        if t - band.at >= REFRESH_S or t < band.at:
            fresh = {n: v for n, (seen, v) in band.latest.items() if t - seen <= MAX_AGE_S}
            for gone in band.latest.keys() - fresh.keys():
                del band.latest[gone]
                self._band_of.pop(gone, None)
            band.ordered, band.used, band.at = sorted(fresh.values()), fresh, t
        ordered, own = band.ordered, band.used.get(node)
        # The median of the others (the node is not its own peer), without copying: the
        # others are `ordered` with one copy of the node's own value skipped.
        skip = bisect.bisect_left(ordered, own) if own is not None else len(ordered)
        count = len(ordered) - (1 if own is not None else 0)
        if count < MIN_PEERS:
            return None

        def other(j: int) -> float:
            return ordered[j] if j < skip else ordered[j + 1]

        mid = count // 2
        value = other(mid) if count % 2 else (other(mid - 1) + other(mid)) / 2
        return round(value, 2)
