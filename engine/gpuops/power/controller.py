"""The controller: telemetry in, per-node limit changes out, each group under its budget.

It keeps the last reading of each GPU (bounded by the fleet), asks `allocate` for each
budgeted group's limits, takes the lowest where a GPU is in several groups, then smooths:

- a cut that a budget needs is sent at once (the budget holds after one interval);
- a raise is at most `step_w`, not within `dwell_s` of the GPU's last change, and not at
  all for less than `hysteresis_w`; a cut that small, or within the dwell, is skipped
  while the group has the slack for it. So limits settle instead of oscillating;
- a GPU whose node is under no budget any more goes back to its policy value at once;
- a node of a group that has sent no reading since the controller started (an engine
  restart, an agent down) is counted at the limits its allocation record says it was
  left at (`recorded`): counted as 0 W, its share went to the others, over the budget. A
  node never capped (no record) draws within its policy, as it did before any budget.

The same class runs in the engine (gpuops/power/engine.py) and in `gpuops bench power`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from gpuops.power.allocate import Allocation, GpuDemand, Key, Use, allocate
from gpuops.power.budgets import GroupBudget
from gpuops.power.config import PowerSettings

POWER_CAP = 0x4  # clocks-event reason: software power cap


class Reading(NamedTuple):
    """One GPU's power readings from a telemetry sample.

    A tuple: one is made for every GPU sample the engine handles, at a third of a frozen
    dataclass's cost."""

    gpu: int  # its index on the node
    power_w: float
    limit_w: float
    min_w: float
    max_w: float
    default_w: float | None
    util: float
    reasons: int


@dataclass(frozen=True, slots=True)
class NodePolicy:
    """A node's policy limit (inventory gpu_power_policy_w) and its guaranteed floor."""

    policy_w: float | None = None
    floor_w: float = 0.0


@dataclass(slots=True)
class _Gpu:
    node: str
    reading: Reading
    seen_at: float
    sent_w: float | None = None
    sent_at: float = float("-inf")
    changed_at: float = float("-inf")


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """One group's budget, its allocation, and what its GPUs draw and are allowed now."""

    budget: GroupBudget
    allocation: Allocation
    uses: dict[Key, Use]
    draw_w: float
    limits_w: float
    unseen: tuple[str, ...] = ()  # nodes of the group with no reading yet
    held_w: float = 0.0  # what the unseen ones are counted at (their recorded limits)

    @property
    def feasible(self) -> bool:
        """Whether the floors fit in the budget."""
        return self.allocation.feasible


@dataclass(frozen=True, slots=True)
class NodeChange:
    """New limits for some GPUs of one node, what they were, and why."""

    node: str
    limits: dict[int, float]
    before: dict[int, float]
    groups: tuple[str, ...]  # the budgeted groups it is in; none: back to policy

    @property
    def restore(self) -> bool:
        """A return to policy: no budget holds for the node any more."""
        return not self.groups


@dataclass(frozen=True, slots=True)
class Plan:
    """What one controller step found and wants to change."""

    at: float
    groups: list[GroupPlan]
    changes: list[NodeChange]
    released: list[str] = field(default_factory=list)  # nodes back at policy, no budget

    @property
    def infeasible(self) -> list[GroupPlan]:
        """Groups whose floors alone exceed their budget."""
        return [g for g in self.groups if not g.feasible]


@dataclass
class PowerController:
    """Keeps groups under their budgets by changing GPU power limits."""

    settings: PowerSettings
    policies: Mapping[str, NodePolicy] = field(default_factory=dict)
    gpus: dict[Key, _Gpu] = field(default_factory=dict)
    managed: set[str] = field(default_factory=set)  # nodes with limits this set
    # The watts each managed node's allocation record says its GPUs were left at, as the
    # engine loaded them at start: what a node not heard from since is counted at.
    recorded: dict[str, float] = field(default_factory=dict)

    def observe(self, node: str, readings: Iterable[Reading], at: float) -> None:
        """Take a node's telemetry; a change sent earlier counts once it shows."""
        for r in readings:
            key = (node, r.gpu)
            gpu = self.gpus.get(key)
            if gpu is None:
                self.gpus[key] = _Gpu(node, r, at)
                continue
            if at < gpu.seen_at:
                continue  # an older sample arriving late says nothing new
            gpu.reading, gpu.seen_at = r, at
            if gpu.sent_w is not None and abs(r.limit_w - gpu.sent_w) < 0.5:
                gpu.sent_w = None

    def sent(self, change: NodeChange, at: float) -> None:
        """The engine accepted a change: count it as the GPUs' limits until telemetry shows it."""
        for index, watts in change.limits.items():
            gpu = self.gpus.get((change.node, index))
            if gpu is not None:
                gpu.sent_w, gpu.sent_at, gpu.changed_at = watts, at, at
        if not change.restore:
            self.managed.add(change.node)

    def current(self, key: Key, now: float) -> float:
        """The GPU's limit as far as the controller knows: sent and pending, else reported."""
        gpu = self.gpus[key]
        if gpu.sent_w is not None and now - gpu.sent_at < self.settings.pending_s:
            return gpu.sent_w
        return gpu.reading.limit_w

    def _shows(self, key: Key, watts: float, now: float) -> bool:
        """Telemetry reports `watts` and no change of the controller is on its way."""
        gpu = self.gpus[key]
        pending = gpu.sent_w is not None and now - gpu.sent_at < self.settings.pending_s
        return not pending and abs(gpu.reading.limit_w - watts) < 0.5

    def policy_w(self, key: Key) -> float:
        """The GPU's limit outside budgets."""
        r = self.gpus[key].reading
        chosen = self.policies.get(key[0], NodePolicy()).policy_w or r.default_w or r.max_w
        return min(max(chosen, r.min_w), r.max_w)

    def policy_total(self, nodes: Iterable[str]) -> tuple[float, int]:
        """The policy limits of the GPUs it has seen on `nodes`, summed, and how many."""
        wanted = set(nodes)
        keys = [k for k in self.gpus if k[0] in wanted]
        return sum(self.policy_w(k) for k in keys), len(keys)

    def demand(self, key: Key, now: float) -> GpuDemand:
        """What the allocation needs to know of one GPU."""
        gpu, s = self.gpus[key], self.settings
        r, limit = gpu.reading, self.current(key, now)
        if now - gpu.seen_at > s.stale_s:
            use = Use.FIXED
        elif r.reasons & POWER_CAP and r.power_w >= min(limit, r.limit_w) - s.headroom_w:
            use = Use.LIMITED
        elif r.util < s.idle_util:
            use = Use.IDLE
        else:
            use = Use.ACTIVE
        floor = self.policies.get(key[0], NodePolicy()).floor_w
        return GpuDemand(
            key, r.min_w, r.max_w, self.policy_w(key), limit, r.power_w, r.util, use, floor
        )

    def plan(self, budgets: Iterable[GroupBudget], now: float) -> Plan:
        """One step: each group's allocation and the changes that keep them."""
        groups, target, member = self._allocate(list(budgets), now)
        new = self._smooth(groups, target, member, now)
        released = []
        for node in sorted(self.managed):  # no budget holds for these any more: to policy
            keys = [k for k in self.gpus if k[0] == node]
            if any(k in member for k in keys):
                continue
            new.update({k: self.policy_w(k) for k in keys})
            # No reading of the node yet (an engine just started): it is still ours.
            if keys and all(self._shows(k, self.policy_w(k), now) for k in keys):
                released.append(node)  # telemetry shows it: the node is no longer ours
                self.managed.discard(node)
        return Plan(now, groups, self._changes(new, member, now), released)

    def _allocate(
        self, budgets: list[GroupBudget], now: float
    ) -> tuple[list[GroupPlan], dict[Key, float], dict[Key, list[GroupPlan]]]:
        by_node: dict[str, list[Key]] = {}
        for key in self.gpus:
            by_node.setdefault(key[0], []).append(key)
        groups: list[GroupPlan] = []
        target: dict[Key, float] = {}
        member: dict[Key, list[GroupPlan]] = {}
        for budget in budgets:
            keys = [k for n in sorted(budget.nodes) for k in sorted(by_node.get(n, []))]
            demands = [self.demand(k, now) for k in keys]
            unseen = tuple(sorted(n for n in budget.nodes if n not in by_node))
            held_w = sum(self.recorded.get(n, 0.0) for n in unseen if n in self.managed)
            allocation = allocate(budget.watts - held_w, demands, self.settings.headroom_w)
            plan = GroupPlan(
                budget,
                allocation,
                {d.key: d.use for d in demands},
                sum(d.draw_w for d in demands),
                sum(d.limit_w for d in demands),
                unseen,
                held_w,
            )
            groups.append(plan)
            for key, watts in allocation.limits.items():
                target[key] = min(watts, target.get(key, watts))
                member.setdefault(key, []).append(plan)
        return groups, target, member

    def _smooth(
        self,
        groups: list[GroupPlan],
        target: dict[Key, float],
        member: dict[Key, list[GroupPlan]],
        now: float,
    ) -> dict[Key, float]:
        s = self.settings
        new: dict[Key, float] = {}
        skippable: list[tuple[float, Key]] = []
        for key, want in target.items():
            cur, d = self.current(key, now), self.demand(key, now)
            settled = now - self.gpus[key].changed_at < s.dwell_s
            if want > cur and cur < d.lo:
                new[key] = max(d.lo, min(want, cur + s.step_w))  # a floor is restored at once
            elif want > cur:
                small = want - cur < s.hysteresis_w
                new[key] = cur if small or settled else min(want, cur + s.step_w)
            else:
                new[key] = want
                if want < cur and (cur - want < s.hysteresis_w or settled):
                    skippable.append((cur - want, key))
        slack = {
            id(g): g.budget.watts - g.held_w - sum(new[k] for k in g.allocation.limits)
            for g in groups
        }
        for extra, key in sorted(skippable):
            mine = member[key]
            if all(slack[id(g)] >= extra for g in mine):
                new[key] += extra
                for g in mine:
                    slack[id(g)] -= extra
        return new

    def _changes(
        self, new: dict[Key, float], member: dict[Key, list[GroupPlan]], now: float
    ) -> list[NodeChange]:
        by_node: dict[str, NodeChange] = {}
        for key in sorted(new):
            watts, cur = new[key], self.current(key, now)
            if abs(watts - cur) < 0.5 or self.demand(key, now).use is Use.FIXED:
                continue
            node, index = key
            groups = tuple(sorted(g.budget.group for g in member.get(key, [])))
            change = by_node.setdefault(node, NodeChange(node, {}, {}, groups))
            change.limits[index], change.before[index] = watts, cur
            if groups and not change.groups:  # one budgeted GPU makes the node budgeted
                by_node[node] = NodeChange(node, change.limits, change.before, groups)
        return list(by_node.values())
