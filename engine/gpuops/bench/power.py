"""`gpuops bench power`: a mixed fleet through a peak window under a budget, two policies.

The fleet (training, inference and idle nodes, racks of ten) runs on the performance
model (gpuops/sim/power_model.py) on a simulated clock. During the window every rack
has a budget of `share` of its nameplate power. Two policies meet it:

- uniform: every GPU capped at budget / GPUs when the window opens, back at its end;
- controller: the engine's own PowerController (gpuops/power/controller.py), fed the
  same readings the agents send, stepping every interval and when a budget changes.

A limit sent takes `latency_s` to apply (a playbook run). Reported per policy: time and
peak over budget, throughput kept (of the same work at the policy limit), changes sent.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from gpuops.power.budgets import GroupBudget
from gpuops.power.config import PowerSettings
from gpuops.power.controller import PowerController, Reading
from gpuops.power.units import format_watts
from gpuops.sim.power_model import Point, PowerModel, Workload, h200_model

RACK = 10  # nodes per rack
POLICY_W = 700.0


@dataclass(frozen=True, slots=True)
class BenchSpec:
    """The run: fleet, budget, timing."""

    nodes: int = 100
    gpus: int = 8
    share: float = 0.7
    interval_s: float = 30.0
    latency_s: float = 10.0
    dt_s: float = 5.0
    before_s: float = 300.0
    window_s: float = 3600.0
    after_s: float = 300.0
    seed: int = 7


@dataclass
class Tally:
    """What one policy did."""

    name: str
    over_s: float = 0.0
    over_after_first_s: float = 0.0  # over budget later than one interval (+ apply) in
    peak_over_w: float = 0.0
    work: float = 0.0
    work_at_policy: float = 0.0
    gpu_changes: int = 0
    node_changes: int = 0
    restored: bool = False
    peak_rack_w: dict[str, float] = field(default_factory=dict)

    @property
    def kept(self) -> float:
        """Throughput kept during the window, of the same work at the policy limit."""
        return self.work / self.work_at_policy if self.work_at_policy else 1.0

    def line(self) -> str:
        """The policy's figures for people."""
        return (
            f"{self.name:10} over budget {self.over_s:6.0f}s (after first interval "
            f"{self.over_after_first_s:.0f}s), peak over {format_watts(self.peak_over_w):>9}, "
            f"throughput kept {100 * self.kept:5.1f}%, limit changes {self.gpu_changes} "
            f"GPUs in {self.node_changes} node intents, back to policy after: "
            f"{'yes' if self.restored else 'NO'}"
        )


class Fleet:
    """Racks of nodes whose GPUs run named workloads, on the model."""

    def __init__(self, spec: BenchSpec, model: PowerModel) -> None:
        self.spec, self.model = spec, model
        rng = random.Random(spec.seed)
        kinds = ["training"] * 5 + ["inference"] * 3 + ["idle"] * 2
        self.kind = {f"node-{i + 1:03d}": rng.choice(kinds) for i in range(spec.nodes)}
        idle = [n for n, k in self.kind.items() if k == "idle"]
        self.starters = set(rng.sample(idle, len(idle) // 3))  # jobs start mid-window
        self.phase = {(n, g): rng.random() for n in self.kind for g in range(spec.gpus)}
        self.limits = {key: POLICY_W for key in self.phase}
        self._points: dict[tuple[Workload, float], Point] = {}
        nodes = sorted(self.kind)
        self.racks = {
            f"rack-{r // RACK + 1:02d}": frozenset(nodes[r : r + RACK])
            for r in range(0, len(nodes), RACK)
        }

    def workload(self, node: str, gpu: int, t: float) -> Workload:
        """What runs on a GPU at `t` (simulated seconds from the start)."""
        kind = self.kind[node]
        s = self.spec
        if kind == "idle" and node in self.starters and t >= s.before_s + s.window_s / 2:
            kind = "training"
        if kind != "inference":
            return self.model.workload(kind)
        wave = 0.5 + 0.5 * math.sin(2 * math.pi * (t / 600.0 + self.phase[node, gpu]))
        wave = round(wave, 2)  # traffic comes and goes (in steps: the points are cached)
        return Workload("inference", 0.15 + 0.25 * wave, 0.5, 35.0 + 50.0 * wave)

    def at(self, work: Workload, limit_w: float) -> Point:
        """The model's operating point, remembered (the same few come back every step)."""
        key = (work, limit_w)
        point = self._points.get(key)
        if point is None:
            point = self._points[key] = self.model.at(work, limit_w)
        return point


def _budgets(fleet: Fleet, t: float) -> list[GroupBudget]:
    s = fleet.spec
    if not s.before_s <= t < s.before_s + s.window_s:
        return []
    per_rack = {r: len(nodes) * s.gpus * POLICY_W * s.share for r, nodes in fleet.racks.items()}
    return [GroupBudget(r, per_rack[r], "peak window", nodes) for r, nodes in fleet.racks.items()]


def run_policy(spec: BenchSpec, controlled: bool, model: PowerModel | None = None) -> Tally:
    """One pass of the fleet through the window under one policy."""
    fleet = Fleet(spec, model or h200_model())
    tally = Tally("controller" if controlled else "uniform")
    controller = PowerController(PowerSettings(interval_s=spec.interval_s))
    pending: list[tuple[float, str, dict[int, float]]] = []
    last_step, last_budgets = float("-inf"), dict[str, float]()
    end = spec.before_s + spec.window_s + spec.after_s
    t = 0.0
    while t < end:
        budgets = _budgets(fleet, t)
        watts = {b.group: b.watts for b in budgets}
        points = _points(fleet, _apply_due(fleet, pending, t))
        if controlled:
            _observe(controller, fleet, points, t)
            if t - last_step >= spec.interval_s or watts != last_budgets:
                last_step = t
                plan = controller.plan(budgets, t)
                for change in plan.changes:
                    controller.sent(change, t)
                    pending.append((t + spec.latency_s, change.node, change.limits))
                    tally.node_changes += 1
                    tally.gpu_changes += len(change.limits)
        elif watts != last_budgets:
            _uniform(fleet, budgets, pending, t, tally)
        last_budgets = watts
        _count(fleet, budgets, points, t, tally)
        t += spec.dt_s
    _apply_due(fleet, pending, end + spec.latency_s)
    tally.restored = all(w == POLICY_W for w in fleet.limits.values())
    return tally


def _uniform(
    fleet: Fleet,
    budgets: list[GroupBudget],
    pending: list[tuple[float, str, dict[int, float]]],
    t: float,
    tally: Tally,
) -> None:
    """The static policy: one cap for every GPU of a rack, set when the window opens."""
    caps = {n: b.watts / (len(b.nodes) * fleet.spec.gpus) for b in budgets for n in b.nodes}
    m = fleet.model
    for node in fleet.kind:
        cap = min(max(caps.get(node, POLICY_W), m.min_limit_w), m.max_limit_w)
        pending.append((t + fleet.spec.latency_s, node, dict.fromkeys(range(fleet.spec.gpus), cap)))
        tally.node_changes += 1
        tally.gpu_changes += fleet.spec.gpus


def _apply_due(fleet: Fleet, pending: list[tuple[float, str, dict[int, float]]], t: float) -> float:
    """Limits whose run finished by `t` take effect."""
    for item in [p for p in pending if p[0] <= t]:
        pending.remove(item)
        for gpu, watts in item[2].items():
            fleet.limits[item[1], gpu] = watts
    return t


Points = dict[tuple[str, int], tuple[float, Point, Point]]  # limit, there, at policy


def _points(fleet: Fleet, t: float) -> Points:
    """Every GPU's operating point at `t` under its limit, and under the policy limit."""
    out = {}
    for key, limit in fleet.limits.items():
        work = fleet.workload(*key, t)
        out[key] = (limit, fleet.at(work, limit), fleet.at(work, POLICY_W))
    return out


def _observe(
    controller: PowerController,
    fleet: Fleet,
    points: Points,
    t: float,
) -> None:
    m = fleet.model
    by_node: dict[str, list[Reading]] = {}
    for (node, gpu), (limit, p, _) in points.items():
        reasons = 0x4 if p.limited else 0
        reading = Reading(
            gpu, p.power_w, limit, m.min_limit_w, m.max_limit_w, POLICY_W, p.util, reasons
        )
        by_node.setdefault(node, []).append(reading)
    for node, readings in by_node.items():
        controller.observe(node, readings, t)


def _count(
    fleet: Fleet,
    budgets: list[GroupBudget],
    points: Points,
    t: float,
    tally: Tally,
) -> None:
    if not budgets:
        return
    s, over_any = fleet.spec, False
    for b in budgets:
        draw = 0.0
        for node in b.nodes:
            for gpu in range(s.gpus):
                _, p, full = points[node, gpu]
                draw += p.power_w
                tally.work += p.throughput
                tally.work_at_policy += full.throughput
        tally.peak_rack_w[b.group] = max(tally.peak_rack_w.get(b.group, 0.0), draw)
        if draw > b.watts:
            over_any = True
            tally.peak_over_w = max(tally.peak_over_w, draw - b.watts)
    if over_any:
        tally.over_s += s.dt_s
        if t >= s.before_s + s.interval_s + s.latency_s:
            tally.over_after_first_s += s.dt_s


def bench_power(spec: BenchSpec) -> Iterator[str]:
    """Both policies on the same fleet; report lines, the last machine-readable."""
    fleet = Fleet(spec, h200_model())
    mix = {
        k: sum(1 for v in fleet.kind.values() if v == k) for k in ("training", "inference", "idle")
    }
    nameplate = spec.nodes * spec.gpus * POLICY_W
    yield (
        f"{spec.nodes} nodes x {spec.gpus} H200 ({', '.join(f'{v} {k}' for k, v in mix.items())}; "
        f"{len(fleet.starters)} idle nodes start training mid-window), {len(fleet.racks)} racks"
    )
    yield (
        f"window {spec.window_s / 60:.0f} min, budget {100 * spec.share:.0f}% of nameplate "
        f"({format_watts(nameplate * spec.share)} of {format_watts(nameplate)}), "
        f"interval {spec.interval_s:.0f}s, a limit applies {spec.latency_s:.0f}s after it is sent"
    )
    uniform = run_policy(spec, controlled=False)
    controller = run_policy(spec, controlled=True)
    yield uniform.line()
    yield controller.line()
    ok = controller.over_after_first_s == 0 and controller.kept > uniform.kept
    yield (
        f"uniform_over_s={uniform.over_s:.0f} uniform_peak_over_w={uniform.peak_over_w:.0f} "
        f"uniform_kept={uniform.kept:.4f} uniform_changes={uniform.gpu_changes} "
        f"controller_over_s={controller.over_s:.0f} "
        f"controller_over_after_first_s={controller.over_after_first_s:.0f} "
        f"controller_peak_over_w={controller.peak_over_w:.0f} "
        f"controller_kept={controller.kept:.4f} controller_changes={controller.gpu_changes} "
        f"controller_intents={controller.node_changes} ok={str(ok).lower()}"
    )
