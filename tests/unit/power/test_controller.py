"""The controller over time: budgets kept after one step, floors kept, hysteresis, steps,
dwell, and the return to policy."""

from __future__ import annotations

from gpuops.match.facts import Telemetry, with_derived
from gpuops.models import GpuSample
from gpuops.power.budgets import GroupBudget
from gpuops.power.config import PowerSettings
from gpuops.power.controller import NodeChange, NodePolicy, Plan, PowerController, Reading
from gpuops.power.engine import readings

T0 = 1_767_225_600.0


def _reading(index: int, limit: float, util: float, draw: float | None = None) -> Reading:
    """A GPU drawing what its work wants, up to its limit (then power-capped, 0x4)."""
    want = 690.0 * util / 100 + 78.0 * (1 - util / 100) if draw is None else draw
    capped = want >= limit - 10
    return Reading(
        index, min(want, limit - 10), limit, 200.0, 700.0, 700.0, util, 4 if capped else 0
    )


class Rack:
    """Nodes whose GPUs apply the limits the controller sends (as a playbook run would)."""

    def __init__(self, utils: dict[str, list[float]]) -> None:
        self.utils = utils
        self.limits = {(n, i): 700.0 for n, us in utils.items() for i in range(len(us))}

    def feed(self, c: PowerController, at: float) -> None:
        for node, utils in self.utils.items():
            c.observe(node, [_reading(i, self.limits[node, i], u) for i, u in enumerate(utils)], at)

    def apply(self, c: PowerController, plan: Plan) -> None:
        for change in plan.changes:
            c.sent(change, plan.at)
            for i, w in change.limits.items():
                self.limits[change.node, i] = w

    def draw(self) -> float:
        return sum(
            _reading(i, self.limits[n, i], u).power_w
            for n, us in self.utils.items()
            for i, u in enumerate(us)
        )


def _budget(watts: float, nodes: list[str]) -> GroupBudget:
    return GroupBudget("rack-a1", watts, "override by test", frozenset(nodes))


def _step(c: PowerController, rack: Rack, budget: list[GroupBudget], at: float) -> Plan:
    rack.feed(c, at)
    plan = c.plan(budget, at)
    rack.apply(c, plan)
    return plan


def test_one_step_brings_the_rack_under_its_budget_and_idle_gpus_go_to_their_minimum() -> None:
    rack = Rack({"n1": [100.0] * 4, "n2": [100.0] * 3 + [0.0]})
    c = PowerController(PowerSettings())
    budget = [_budget(4000.0, ["n1", "n2"])]
    plan = _step(c, rack, budget, T0)
    assert sum(rack.limits.values()) <= 4000.0 and rack.draw() <= 4000.0
    assert rack.limits["n2", 3] == 200.0, "the idle GPU gives its watts first"
    assert {c.node for c in plan.changes} == {"n1", "n2"}, "one change per node"


def test_a_guaranteed_node_keeps_its_floor_while_the_rest_of_the_rack_is_capped() -> None:
    rack = Rack({"gold": [100.0] * 4, "n2": [100.0] * 4, "n3": [100.0] * 4})
    c = PowerController(PowerSettings(), {"gold": NodePolicy(floor_w=650.0)})
    _step(c, rack, [_budget(5000.0, list(rack.utils))], T0)
    assert all(rack.limits["gold", i] >= 650.0 for i in range(4))
    others = [w for (n, _), w in rack.limits.items() if n != "gold"]
    assert max(others) < 650.0 and min(others) >= 200.0
    assert sum(rack.limits.values()) <= 5000.0


def test_floors_above_the_budget_are_kept_and_the_plan_names_the_group() -> None:
    rack = Rack({"gold": [100.0] * 4})
    c = PowerController(PowerSettings(), {"gold": NodePolicy(floor_w=650.0)})
    plan = _step(c, rack, [_budget(2000.0, ["gold"])], T0)
    assert [g.budget.group for g in plan.infeasible] == ["rack-a1"]
    assert set(rack.limits.values()) == {650.0}, "a guarantee is never broken"


def test_raises_are_bounded_by_step_and_dwell_and_cuts_that_keep_the_budget_are_not() -> None:
    rack = Rack({"n1": [100.0] * 4})
    s = PowerSettings(step_w=50.0, dwell_s=60.0, hysteresis_w=20.0)
    c = PowerController(s)
    _step(c, rack, [_budget(1600.0, ["n1"])], T0)
    assert sum(rack.limits.values()) <= 1600.0, "the cut went out at once"
    before = dict(rack.limits)
    plan = _step(c, rack, [_budget(2400.0, ["n1"])], T0 + 30)
    assert plan.changes == [] and rack.limits == before, "within the dwell: no raise"
    _step(c, rack, [_budget(2400.0, ["n1"])], T0 + 61)
    assert all(rack.limits[k] == before[k] + 50.0 for k in before), "one bounded step"


def test_small_moves_within_the_hysteresis_are_not_sent() -> None:
    rack = Rack({"n1": [100.0, 100.0, 90.0, 100.0]})
    c = PowerController(PowerSettings(hysteresis_w=20.0, dwell_s=0.0))
    for k in range(3):
        _step(c, rack, [_budget(2000.0, ["n1"])], T0 + 30 * k)
    rack.utils["n1"][2] = 91.0  # its draw, and so every target, moves by a few watts
    plan = _step(c, rack, [_budget(2000.0, ["n1"])], T0 + 120)
    assert plan.changes == []
    assert sum(rack.limits.values()) <= 2000.0


def test_limits_do_not_oscillate_under_a_steady_load() -> None:
    rack = Rack({"n1": [100.0, 60.0, 30.0, 0.0], "n2": [100.0, 100.0, 80.0, 5.0]})
    c = PowerController(PowerSettings())
    budget = [_budget(3200.0, ["n1", "n2"])]
    changes = [len(_step(c, rack, budget, T0 + 30 * k).changes) for k in range(40)]
    assert sum(rack.limits.values()) <= 3200.0
    assert changes[-10:] == [0] * 10, f"settled: {changes}"


def test_when_the_budget_ends_limits_return_to_policy_and_the_node_is_released() -> None:
    rack = Rack({"n1": [100.0] * 4})
    c = PowerController(PowerSettings(), {"n1": NodePolicy(policy_w=680.0)})
    _step(c, rack, [_budget(1600.0, ["n1"])], T0)
    assert c.managed == {"n1"}
    plan = _step(c, rack, [], T0 + 30)
    assert [ch.restore for ch in plan.changes] == [True]
    assert set(rack.limits.values()) == {680.0}, "policy value, at once"
    assert _step(c, rack, [], T0 + 60).released == ["n1"] and c.managed == set()


def test_a_gpu_without_fresh_telemetry_is_left_alone_and_counted_at_its_limit() -> None:
    rack = Rack({"n1": [100.0] * 2, "n2": [100.0] * 2})
    c = PowerController(PowerSettings(stale_s=60.0))
    rack.feed(c, T0)
    rack.utils.pop("n2")  # n2's agent goes quiet
    rack.feed(c, T0 + 120)
    plan = c.plan([_budget(2000.0, ["n1", "n2"])], T0 + 120)
    assert [ch.node for ch in plan.changes] == ["n1"]
    assert sum(plan.changes[0].limits.values()) <= 2000.0 - 2 * 700.0


def test_a_change_counts_from_when_it_was_sent_until_telemetry_shows_it() -> None:
    rack = Rack({"n1": [100.0] * 2})
    c = PowerController(PowerSettings())
    rack.feed(c, T0)
    plan = c.plan([_budget(1000.0, ["n1"])], T0)
    c.sent(plan.changes[0], T0)  # accepted, not yet run: telemetry still says 700
    rack.feed(c, T0 + 10)
    assert c.plan([_budget(1000.0, ["n1"])], T0 + 10).changes == [], "not sent twice"
    assert isinstance(plan.changes[0], NodeChange)


def test_a_budget_that_ends_before_its_cut_ran_restores_policy_before_letting_go() -> None:
    rack = Rack({"n1": [100.0] * 2})
    c = PowerController(PowerSettings())
    rack.feed(c, T0)
    cut = c.plan([_budget(1000.0, ["n1"])], T0)
    c.sent(cut.changes[0], T0)  # decided; its run has not happened yet
    rack.feed(c, T0 + 30)  # still 700 W: the node looks at policy, but the cut is coming
    plan = c.plan([], T0 + 30)
    assert plan.released == [] and c.managed == {"n1"}
    assert [set(ch.limits.values()) for ch in plan.changes] == [{700.0}], "restore sent"


def test_after_a_restart_a_node_is_not_let_go_before_its_telemetry_shows_policy() -> None:
    # An engine that starts again knows the nodes it held (their records) before any
    # sample arrives: with nothing read yet, nothing shows policy, so they stay held.
    c = PowerController(PowerSettings(), {"n1": NodePolicy(policy_w=700.0)})
    c.managed.add("n1")

    plan = c.plan([], T0)

    assert plan.released == [] and c.managed == {"n1"}


def test_a_samples_readings_are_typed_and_gpus_without_power_left_out() -> None:
    def gpu(index: int, **fields: object) -> dict[str, object]:
        return dict(
            GpuSample.model_validate({"index": index, "uuid": f"GPU-{index}", **fields}).__dict__
        )

    full = {
        "power_w": 650,
        "power_limit_w": 700.0,
        "power_min_limit_w": 200.0,
        "power_max_limit_w": 700.0,
        "power_default_limit_w": 700.0,
    }
    facts = with_derived(
        [gpu(0, **full, util_gpu=97, clocks_event_reasons=4), gpu(1, **full), gpu(2, util_gpu=50)],
        "n1",
    )
    got = readings(Telemetry("e1", "n1", 1.0, "test", facts))
    assert got == [
        Reading(0, 650.0, 700.0, 200.0, 700.0, 700.0, 97.0, 4),
        Reading(1, 650.0, 700.0, 200.0, 700.0, 700.0, 0.0, 0),  # no util, no reasons
    ]
    assert all(isinstance(r, Reading) and isinstance(r.power_w, float) for r in got)
    assert got[0].limit_w == 700.0 and got[1].util == 0.0


def test_a_node_not_heard_from_since_a_restart_is_counted_at_its_recorded_limits() -> None:
    """Review of issue 30: after an engine restart only node A had reported; B, capped at
    500 W a GPU before the restart and still drawing that, counted as 0 W, and A was raised
    to 1,400 W: 2,400 W on a 2,000 W budget, the plan saying all was well."""
    c = PowerController(PowerSettings(), {"A": NodePolicy(700.0), "B": NodePolicy(700.0)})
    c.managed |= {"A", "B"}  # as the engine loads them from their allocation records
    c.recorded |= {"A": 1000.0, "B": 1000.0}
    budget = [_budget(2000.0, ["A", "B"])]
    rack = Rack({"A": [100.0, 100.0], "B": [100.0, 100.0]})
    rack.limits = dict.fromkeys(rack.limits, 500.0)
    at = T0
    for _ in range(8):  # B's agent is down: only A reports
        c.observe("A", [_reading(i, rack.limits["A", i], 100.0) for i in range(2)], at)
        plan = c.plan(budget, at)
        rack.apply(c, plan)
        (group,) = plan.groups
        assert (group.unseen, group.held_w) == (("B",), 1000.0)
        at += 330
    assert rack.limits["A", 0] + rack.limits["A", 1] <= 1000.0, "A gets what B leaves"
    rack.feed(c, at)  # B reports: its draw is known
    plan = c.plan(budget, at)
    rack.apply(c, plan)
    assert plan.groups[0].unseen == ()
    assert sum(rack.limits.values()) <= 2000.0


def test_a_host_never_capped_and_never_heard_from_holds_nothing_back() -> None:
    """A login host in the rack's group (no GPU, no record): the rack's GPUs are raised to
    what the budget allows, as if it were not there."""
    c = PowerController(PowerSettings(), {"A": NodePolicy(700.0)})
    budget = [_budget(6000.0, ["A", "login01"])]
    rack = Rack({"A": [100.0, 100.0]})
    rack.limits = dict.fromkeys(rack.limits, 300.0)
    at = T0
    for _ in range(40):
        _step(c, rack, budget, at)
        at += 330
    assert rack.limits == {("A", 0): 700.0, ("A", 1): 700.0}
