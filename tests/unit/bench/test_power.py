"""`gpuops bench power` on a small fleet: the controller keeps every rack within budget
after its first interval and keeps more throughput than a uniform cap."""

from __future__ import annotations

from gpuops.bench.power import BenchSpec, run_policy


def test_the_controller_keeps_the_budget_and_more_throughput_than_a_uniform_cap() -> None:
    spec = BenchSpec(nodes=20, window_s=900.0, before_s=60.0, after_s=120.0)
    uniform, controller = run_policy(spec, controlled=False), run_policy(spec, controlled=True)
    assert controller.over_after_first_s == 0.0
    assert controller.over_s <= spec.latency_s, "over only until its first limits apply"
    assert controller.kept > uniform.kept
    assert controller.restored and uniform.restored, "both back at policy after the window"
