"""The allocation of one budget: property tests of its guarantees, and the cases people ask."""

from __future__ import annotations

from gpuops.power.allocate import GpuDemand, Use, allocate
from hypothesis import given, settings
from hypothesis import strategies as st

EPS = 1e-6


@st.composite
def gpus(draw: st.DrawFn) -> list[GpuDemand]:
    n = draw(st.integers(1, 24))
    out = []
    for i in range(n):
        lo = draw(st.floats(100, 300))
        hi = draw(st.floats(lo, 1000))
        use = draw(st.sampled_from([Use.IDLE, Use.ACTIVE, Use.LIMITED, Use.FIXED]))
        limit = draw(st.floats(lo, hi))
        out.append(
            GpuDemand(
                key=(f"n{i // 8}", i % 8),
                min_w=lo,
                max_w=hi,
                policy_w=draw(st.floats(lo, hi)),
                limit_w=limit,
                draw_w=draw(st.floats(0, limit)),
                util=draw(st.floats(0, 100)),
                use=use,
                floor_w=draw(st.sampled_from([0.0, 0.0, 650.0, draw(st.floats(0, hi))])),
            )
        )
    return out


@settings(max_examples=150, deadline=None)
@given(gpus(), st.floats(0, 1.0), st.floats(0, 60))
def test_limits_keep_every_bound_and_the_budget_when_floors_fit(
    demands: list[GpuDemand], share: float, headroom: float
) -> None:
    lo, hi = sum(g.lo for g in demands), sum(g.hi for g in demands)
    budget = max(1.0, lo + share * (hi - lo) * 1.2 - 10)
    a = allocate(budget, demands, headroom)
    assert set(a.limits) == {g.key for g in demands}
    for g in demands:
        assert g.lo - EPS <= a.limits[g.key] <= g.hi + EPS, "never below a floor or min, above max"
        assert a.limits[g.key] >= g.min_w - EPS and a.limits[g.key] <= g.max_w + EPS
        if g.floor_w:
            assert a.limits[g.key] >= min(g.floor_w, g.max_w) - EPS or g.use is Use.FIXED
    if lo <= budget:
        assert a.feasible and a.total_w <= budget + EPS
    else:
        assert not a.feasible and a.limits == {g.key: g.lo for g in demands}


@settings(max_examples=100, deadline=None)
@given(gpus(), st.floats(0, 1.0))
def test_idle_gpus_get_more_than_their_minimum_only_when_the_limited_ones_are_full(
    demands: list[GpuDemand], share: float
) -> None:
    lo, hi = sum(g.lo for g in demands), sum(g.hi for g in demands)
    a = allocate(lo + share * (hi - lo), demands)
    idle_raised = any(a.limits[g.key] > g.lo + 1 for g in demands if g.use is Use.IDLE)
    if idle_raised:
        for g in demands:
            if g.use is Use.LIMITED:
                assert a.limits[g.key] >= g.hi - 1, "idle first: limited GPUs were full"


@settings(max_examples=100, deadline=None)
@given(gpus(), st.floats(0, 1.0), st.floats(0, 60))
def test_gpus_not_at_their_cap_get_no_more_than_they_draw_while_others_are_limited(
    demands: list[GpuDemand], share: float, headroom: float
) -> None:
    lo, hi = sum(g.lo for g in demands), sum(g.hi for g in demands)
    a = allocate(lo + share * (hi - lo), demands, headroom)
    starved = any(a.limits[g.key] < g.hi - 1 for g in demands if g.use is Use.LIMITED)
    for g in demands:
        if starved and g.use is Use.ACTIVE:
            assert a.limits[g.key] <= max(g.lo, min(g.hi, g.draw_w + headroom)) + 1


def _gpu(node: str, i: int, use: Use, util: float = 100.0, floor: float = 0.0) -> GpuDemand:
    draw = {Use.IDLE: 78.0, Use.ACTIVE: 400.0, Use.LIMITED: 690.0, Use.FIXED: 500.0}[use]
    return GpuDemand((node, i), 200.0, 700.0, 700.0, 700.0, draw, util, use, floor)


def test_limited_gpus_share_by_utilisation() -> None:
    busy, half = _gpu("a", 0, Use.LIMITED, 100), _gpu("a", 1, Use.LIMITED, 50)
    a = allocate(200 + 200 + 300, [busy, half])
    assert a.limits[busy.key] == 400.0 and a.limits[half.key] == 300.0


def test_budget_above_what_the_policy_allows_returns_everyone_to_policy() -> None:
    demands = [_gpu("a", i, Use.LIMITED) for i in range(4)]
    assert allocate(2800.0, demands).limits == {g.key: 700.0 for g in demands}


def test_floors_above_the_budget_are_kept_and_the_allocation_says_it_is_not_feasible() -> None:
    demands = [_gpu("g", i, Use.LIMITED, floor=650) for i in range(4)]
    a = allocate(2000.0, demands)
    assert not a.feasible and a.floors_w == 2600.0
    assert set(a.limits.values()) == {650.0}
