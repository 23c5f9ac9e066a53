"""One group's budget spread over its GPUs where it costs least. Pure: no clock, no I/O.

In order:
1. every GPU gets its low bound: its floor (power class or node) or its device minimum;
   when those alone exceed the budget, that is all it gets and the allocation says it is
   not feasible (a person decides; no guarantee is broken);
2. GPUs in use but not at their cap get what they draw plus a headroom, no more;
3. GPUs that are power-limited (clocks-event 0x4 at their cap) get the rest, weighted by
   utilisation, up to their high bound (policy value, or the device maximum);
4. what is left goes to the GPUs in use, then to idle ones, up to their high bound.

Idle GPUs thus sit at their minimum unless everyone else has what they can use. A GPU
without fresh telemetry is `fixed`: counted at its current limit and left alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

Key = tuple[str, int]  # node, GPU index


class Use(StrEnum):
    """How a GPU uses power, as the allocation sees it."""

    IDLE = "idle"
    ACTIVE = "active"  # in use, not at its cap
    LIMITED = "limited"  # power-limited at its cap: it would use more
    FIXED = "fixed"  # no fresh telemetry: left at its limit


@dataclass(frozen=True, slots=True)
class GpuDemand:
    """What the allocation knows of one GPU."""

    key: Key
    min_w: float
    max_w: float
    policy_w: float
    limit_w: float
    draw_w: float
    util: float
    use: Use
    floor_w: float = 0.0

    @property
    def lo(self) -> float:
        """The least it may get: its floor, never below the device minimum."""
        if self.use is Use.FIXED:
            return self.limit_w
        return min(max(self.min_w, self.floor_w), self.max_w)

    @property
    def hi(self) -> float:
        """The most it may get: the policy value within the device range."""
        if self.use is Use.FIXED:
            return self.limit_w
        return max(self.lo, min(self.policy_w, self.max_w))


@dataclass(frozen=True, slots=True)
class Allocation:
    """Limits per GPU for one budget, and whether the floors fit in it."""

    budget_w: float
    limits: dict[Key, float]
    floors_w: float
    feasible: bool

    @property
    def total_w(self) -> float:
        """The sum of the limits."""
        return sum(self.limits.values())


def allocate(budget_w: float, gpus: Sequence[GpuDemand], headroom_w: float = 30.0) -> Allocation:
    """Limits for `gpus` whose sum stays within `budget_w` whenever their floors fit."""
    lo = {g.key: g.lo for g in gpus}
    floors = sum(lo.values())
    if floors > budget_w:
        return Allocation(budget_w, lo, floors, False)
    if sum(g.hi for g in gpus) <= budget_w:
        return Allocation(budget_w, {g.key: g.hi for g in gpus}, floors, True)
    give = dict(lo)
    left = budget_w - floors
    active = [g for g in gpus if g.use is Use.ACTIVE]
    wants = {g.key: min(g.hi, max(g.lo, g.draw_w + headroom_w)) - g.lo for g in active}
    left = _fill(give, wants, {k: max(w, 1e-9) for k, w in wants.items()}, left)
    limited = [g for g in gpus if g.use is Use.LIMITED]
    room = {g.key: g.hi - give[g.key] for g in limited}
    left = _fill(give, room, {g.key: max(g.util, 1.0) for g in limited}, left)
    for use in (Use.ACTIVE, Use.IDLE):
        more = {g.key: g.hi - give[g.key] for g in gpus if g.use is use}
        left = _fill(give, more, dict.fromkeys(more, 1.0), left)
    return Allocation(budget_w, _whole(give, lo), floors, True)


def _fill(
    give: dict[Key, float], room: dict[Key, float], weight: dict[Key, float], left: float
) -> float:
    """Water-fill `left` watts into `room` by weight (adding to `give`); what is left over."""
    got = dict.fromkeys(room, 0.0)
    open_ = {k for k, r in room.items() if r > 1e-9}
    while left > 1e-9 and open_:
        share = left / sum(weight[k] for k in open_)
        full = {k for k in open_ if weight[k] * share >= room[k] - got[k]}
        if not full:
            for k in open_:
                got[k] += weight[k] * share
            left = 0.0
            break
        for k in full:
            left -= room[k] - got[k]
            got[k] = room[k]
        open_ -= full
    for k, extra in got.items():
        give[k] += extra
    return max(left, 0.0)


def _whole(give: dict[Key, float], lo: dict[Key, float]) -> dict[Key, float]:
    """Whole watts, rounded down (the sum stays within the budget), never below the floor."""
    return {k: float(max(lo[k], math.floor(v + 1e-9))) for k, v in give.items()}
