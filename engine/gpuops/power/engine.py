"""The controller inside the engine: telemetry from the pipeline, a supervised loop, and
every change decided like any rule's action.

- The pipeline hands each telemetry event to the controller (`observer`; bounded: the
  last reading per GPU).
- `poll` steps every `power.interval_s`, and at once when a group's budget changes (an
  override from the CLI or ChatOps, a window opening or closing); `run` polls live,
  shadow mode polls as its clock moves.
- Each node's change is a `Request` handed to the pipeline's entry (`decide`, given at
  construction): a match of the engine's rule `power-budget` (`power_rule`: the
  catalogue's power-limit playbook with per-GPU watts), which no event can match,
  decided through every safety stage (node lock, silence, dry-run, approvals ...) and
  audited with the budget and the allocation behind it. Only an accepted change counts
  as sent; a dropped one is tried again next step.
- The node's allocation is kept in KV (`power.alloc.<node>`): the stage in
  gpuops/power/guard.py reads it to keep other power rules off budgeted GPUs.
- Floors above a budget are kept, and a person is told (needs-human, through the outbox).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import operator
from collections.abc import Callable
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

from gpuops.bus.store import KV, Store
from gpuops.catalog import Catalog, Role
from gpuops.clock import Clock
from gpuops.inventory.domains import FACILITY, Domains
from gpuops.inventory.hosts import Inventory
from gpuops.match.builtin import BUILTIN_FILE
from gpuops.match.facts import Telemetry
from gpuops.match.rules import Rule, RuleAction
from gpuops.models import POWER_KIND, Decide, Decision, Match, Request
from gpuops.power.budgets import FLEET, GroupBudget, Overrides, budgets_now
from gpuops.power.config import PowerSettings
from gpuops.power.controller import (
    GroupPlan,
    NodeChange,
    NodePolicy,
    Plan,
    PowerController,
    Reading,
)
from gpuops.power.units import format_watts
from gpuops.record.outbox import Tell
from gpuops.record.recorder import Recorder

log = logging.getLogger(__name__)

POWER_RULE = "power-budget"
POLL_S = 1.0  # how often overrides are read (a person's budget acts within this)


class NodeAllocation(BaseModel):
    """The limits the controller set on a node, and the budgets they keep (in KV)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    node: str
    groups: tuple[str, ...]
    limits: dict[str, float]
    budgets: dict[str, float]
    at: float


class Sharing(Protocol):
    """Which nodes this replica decides for, and whether others hold some (gpuops.scale)."""

    def owns(self, node: str) -> bool:
        """Whether this replica decides for the node now."""
        ...

    def shared_with_others(self, nodes: frozenset[str]) -> bool:
        """Whether another replica owns some of these nodes."""
        ...


def power_rule(catalog: Catalog) -> Rule:
    """The rule the controller's requests are decided under; no event can match it."""
    return Rule(
        name=POWER_RULE,
        on=POWER_KIND,
        file=BUILTIN_FILE,
        line=0,
        description="the power controller keeps a group under its budget",
        setting=True,
        severity="info",
        actions=(
            RuleAction(
                playbook=catalog.for_role(Role.POWER_LIMIT),
                vars={"limits": "{{ limits }}", "reason": "{{ reason }}"},
            ),
        ),
    )


def observer(controller: PowerController) -> Callable[[Telemetry], None]:
    """What the pipeline calls with each telemetry sample: the controller's readings."""

    def observe(telemetry: Telemetry) -> None:
        controller.observe(telemetry.node, readings(telemetry), telemetry.epoch)

    return observe


def allocations(kv: KV) -> Store[NodeAllocation]:
    """The allocation records in the control bucket."""
    return Store(kv, NodeAllocation, "power.alloc")


def readings(event: Telemetry) -> list[Reading]:
    """The power readings of a telemetry event (GPUs that lack one are left out). The
    readings are as the decoders typed them (the model's floats, whatever the JSON
    wrote), so they are taken without converting them again."""
    out = []
    for g in event.facts:
        index, power, limit, low, high, default, util, reasons = _POWER_OF(g)
        if power is None or limit is None or low is None or high is None:
            continue
        out.append(
            _new(Reading, (index, power, limit, low, high, default, util or 0.0, reasons or 0))
        )
    return out


# A Reading made by tuple's own constructor: NamedTuple's __new__ is Python code, and
# this runs for every GPU sample (the fields are the same, in the same order).
_new = tuple.__new__
# A GPU's fields a Reading is made of, read in one call.
_POWER_OF = operator.itemgetter(
    "index",
    "power_w",
    "power_limit_w",
    "power_min_limit_w",
    "power_max_limit_w",
    "power_default_limit_w",
    "util_gpu",
    "clocks_event_reasons",
)


def node_policies(inventory: Inventory, settings: PowerSettings) -> dict[str, NodePolicy]:
    """Each host's policy limit (gpu_power_policy_w) and floor (power_floor_w, or its class)."""
    out = {}
    for host, hv in inventory.hostvars.items():
        policy = hv.get("gpu_power_policy_w")
        floor = hv.get("power_floor_w")
        if floor is None:
            floor = settings.floors.get(str(hv.get(settings.class_var, "")), 0.0)
        out[host] = NodePolicy(float(policy) if policy is not None else None, float(floor))
    return out


class PowerEngine:
    """Budgets, the controller and its loop, for one engine."""

    def __init__(
        self,
        settings: PowerSettings,
        inventory: Inventory,
        control: KV,
        controller: PowerController,
        decide: Decide,
        sharing: Sharing,
        recorder: Recorder,
        clock: Clock,
    ) -> None:
        self.settings, self.inventory, self.clock = settings, inventory, clock
        self.decide, self.sharing, self.recorder = decide, sharing, recorder
        self.overrides = Overrides(control)
        self.records = allocations(control)
        self.controller = controller
        # Failure domains are groups too (`cooling_loop:cdu-2`): a domain's episode
        # budgets its nodes' power (gpuops.decide.correlate).
        domains = Domains.of(inventory).as_groups()
        every = {**domains, **inventory.groups, FLEET: inventory.hosts}
        # Facility equipment (a CDU's controller) has no GPU to cap nor power to report:
        # in a group's budget it would be a node whose draw is never known.
        facility = inventory.groups.get(FACILITY, frozenset())
        self.hosts_of = {group: hosts - facility for group, hosts in every.items()}
        self.told: dict[str, float] = {}  # group -> the budget a person was told of
        self.split: set[str] = set()  # groups told to be split between replicas
        self.last: Plan | None = None
        self.decided: list[Decision] = []  # the last step's decisions (replaced each step)
        self._loaded = False
        # When budgets were last read and stepped, and what they were (`poll`).
        self._polled = self._stepped = float("-inf")
        self._seen: dict[str, float] | None = None

    async def budgets(self) -> list[GroupBudget]:
        """Every group's budget now."""
        overrides = await self.overrides.all()
        return budgets_now(self.settings, overrides, self.hosts_of, self.clock.now())

    async def run(self, stop: asyncio.Event) -> None:
        """Poll until `stop` (the live engine's loop; shadow mode polls as its clock moves)."""
        while not stop.is_set():
            await self.poll()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), POLL_S)

    async def poll(self) -> list[Decision]:
        """Read the budgets about every POLL_S of the clock; step when one changed or the
        interval passed. The decisions of the step (none when it did not step)."""
        now = self.clock.now()
        if now - self._polled < POLL_S / 2:  # half: the live loop's waits are not exact
            return []
        self._polled = now
        budgets = await self.budgets()
        seen = {b.group: b.watts for b in budgets}
        if seen == self._seen and now - self._stepped < self.settings.interval_s:
            return []
        await self.step(budgets)
        self._stepped, self._seen = now, seen
        return self.decided

    async def step(self, budgets: list[GroupBudget] | None = None) -> Plan:
        """One control step: plan, decide each node's change, keep the records."""
        if not self._loaded:  # nodes a previous run left off policy are still ours
            records = [r for _, r in await self.records.all()]
            self.controller.managed |= {r.node for r in records}
            self.controller.recorded |= {r.node: sum(r.limits.values()) for r in records}
            self._loaded = True
        budgets = await self.budgets() if budgets is None else budgets
        now = self.clock.now()
        budgets = await self._whole(budgets, now)
        plan = self.controller.plan(budgets, now)
        self.last, self.decided = plan, []
        sent = [c for c in plan.changes if await self._decide(c, plan, now)]
        for node in plan.released:
            await self.records.delete(node)
            await self.recorder.auditor.note(now, node, f"power: {node} back at policy")
        await self._tell_infeasible(plan, now)
        if sent:
            await self._note(plan, sent, now)
        return plan

    async def _whole(self, budgets: list[GroupBudget], now: float) -> list[GroupBudget]:
        """The budgets whose every node this replica owns (and so reads the power of).

        A group split between engine replicas is kept by none of them: each would see
        only its own nodes' draw, believe the group under budget and raise limits. People
        are told once, so a budget is never silently not kept (docs/power.md, replicas)."""
        whole = []
        for b in budgets:
            if all(self.sharing.owns(n) for n in b.nodes):
                whole.append(b)
                self.split.discard(b.group)
                continue
            if not self.sharing.shared_with_others(b.nodes):
                # Partitions not all taken yet (a start): planned as before; a change for
                # a node not owned yet is not decided (`_decide`).
                whole.append(b)
                continue
            if b.group in self.split:
                continue  # told already
            self.split.add(b.group)
            text = (
                f"power budget {b.line()} is not kept: its nodes are split between engine "
                "replicas, and a replica reads only its own nodes' power; run one replica "
                "where budgets must hold (docs/power.md)"
            )
            log.warning(text)
            self.recorder.notifier.notify("power budget not kept", text)
            await self.recorder.auditor.note(now, "", text, {"power_budget": b.group})
        return whole

    async def _decide(self, change: NodeChange, plan: Plan, now: float) -> bool:
        if not self.sharing.owns(change.node):
            return False  # another replica owns the node's partition (and its samples)
        decisions = await self.decide(Request(match=self._match(change, plan, now)))
        self.decided += decisions
        if not any(d.accepted for d in decisions):
            return False
        self.controller.sent(change, now)
        if not change.restore:
            await self._record(change, plan, now)
        return True

    async def _record(self, change: NodeChange, plan: Plan, now: float) -> None:
        def merge(old: NodeAllocation | None) -> NodeAllocation:
            limits = dict(old.limits) if old else {}
            limits.update({str(i): w for i, w in change.limits.items()})
            budgets = {g.budget.group: g.budget.watts for g in plan.groups}
            mine = {k: budgets[k] for k in change.groups if k in budgets}
            return NodeAllocation(
                node=change.node, groups=change.groups, limits=limits, budgets=mine, at=now
            )

        await self.records.update(merge, change.node)

    def _match(self, change: NodeChange, plan: Plan, now: float) -> Match:
        groups = {g.budget.group: g for g in plan.groups}
        mine = [groups[name] for name in change.groups if name in groups]
        limits = ",".join(f"{i}:{w:g}" for i, w in sorted(change.limits.items()))
        why = (
            "; ".join(g.budget.line() for g in mine) if mine else "no budget holds: back to policy"
        )
        facts: dict[str, Any] = {
            "node": change.node,
            "limits": limits,
            "reason": f"power budget: {why}",
            "budgets": [_group_facts(g) for g in mine],
            "allocation": {
                str(i): {
                    "from": change.before[i],
                    "to": w,
                    "use": _use(mine, change.node, i),
                }
                for i, w in sorted(change.limits.items())
            },
        }
        gpus = tuple(sorted(change.limits))
        return Match(
            rule=POWER_RULE,
            kind=POWER_KIND,  # the engine's own request: not a fault, and no event has it
            node=change.node,
            gpu=gpus[0] if len(gpus) == 1 else None,
            gpus=gpus,
            key=change.node,
            event_id=f"power-{change.node}-{now:.3f}",
            event_ts=now,
            at=now,
            severity="info",
            facts=facts,
        )

    async def _tell_infeasible(self, plan: Plan, now: float) -> None:
        for g in plan.groups:
            if g.feasible:
                self.told.pop(g.budget.group, None)
                continue
            if self.told.get(g.budget.group) == g.budget.watts:
                continue
            self.told[g.budget.group] = g.budget.watts
            text = (
                f"power budget {g.budget.line()} is below the guaranteed floors of its GPUs "
                f"({format_watts(g.allocation.floors_w)}): floors kept, budget exceeded; "
                "raise the budget, lower a floor or move work"
            )
            log.warning(text)
            self.recorder.outbox.add(
                Tell("needs-human", POWER_RULE, g.budget.group, "node", text), now
            )
            self.recorder.flush()
            await self.recorder.auditor.note(
                now, "", text, {"power": _group_facts(g), "needs_human": True}
            )

    async def _note(self, plan: Plan, sent: list[NodeChange], now: float) -> None:
        nodes = {c.node for c in sent}
        for g in plan.groups:
            changed = sorted(nodes & g.budget.nodes)
            if not changed:
                continue
            allowed = sum(g.allocation.limits.values())
            await self.recorder.auditor.note(
                now,
                "",
                f"power {g.budget.line()}: draw {format_watts(g.draw_w)}, limits "
                f"{format_watts(g.limits_w)} -> {format_watts(allowed)}; "
                f"{len(changed)} nodes changed",
                {"power": _group_facts(g), "nodes": changed},
            )
        restored = sorted(c.node for c in sent if c.restore)
        if restored:
            await self.recorder.auditor.note(
                now, "", f"power: {len(restored)} nodes back to policy", {"nodes": restored}
            )


def _use(groups: list[GroupPlan], node: str, index: int) -> str:
    for g in groups:
        use = g.uses.get((node, index))
        if use is not None:
            return use.value
    return "restore"


def _group_facts(g: GroupPlan) -> dict[str, Any]:
    a = g.allocation
    return {
        "group": g.budget.group,
        "budget_w": g.budget.watts,
        "source": g.budget.source,
        "draw_w": round(g.draw_w, 1),
        "limits_w": round(g.limits_w, 1),
        "allocated_w": a.total_w,
        "floors_w": a.floors_w,
        "feasible": a.feasible,
        "gpus": len(a.limits),
        "unseen": list(g.unseen),
        "unseen_held_w": g.held_w,
    }
