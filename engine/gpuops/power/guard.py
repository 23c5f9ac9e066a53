"""Stage: rules that restore or report power limits leave budgeted GPUs to the controller.

`power-limit-below-policy` restores any limit below policy; under a budget the controller
lowers limits on purpose, and the two would fight. While a node has an allocation record
(the controller set its limits; gpuops/power/engine.py), such a rule's match on it is
dropped with `power_budget`. The record goes when the node is back at policy.
"""

from __future__ import annotations

from gpuops.bus.store import KV, Store
from gpuops.catalog import Catalog, Role
from gpuops.decide.stage import BaseStage, Drop, Proposal
from gpuops.models import Reason
from gpuops.power.config import PowerSettings
from gpuops.power.engine import POWER_RULE, NodeAllocation, allocations


class YieldToBudget(BaseStage):
    """Drops other power rules' matches on nodes whose limits the controller keeps."""

    name = "power_budget"

    def __init__(self, control: KV, settings: PowerSettings, catalog: Catalog) -> None:
        self.records: Store[NodeAllocation] = allocations(control)
        self.catalog = catalog
        self.rules = frozenset(settings.yield_rules)

    def _about_power(self, p: Proposal) -> bool:
        if p.rule.name == POWER_RULE or p.rule.by_person:
            return False
        # The drift fix of the setting `power_limit` (baseline.yml only=power_limit) sets
        # the policy value too: on a budgeted node that would undo the controller.
        baseline_power = p.match.facts.get("setting") == "power_limit"
        return (
            p.rule.name in self.rules
            or baseline_power
            or any(self.catalog.has_role(a.playbook, Role.POWER_LIMIT) for a in p.actions)
        )

    async def check(self, p: Proposal) -> Drop | None:
        if not self._about_power(p):
            return None
        record, _ = await self.records.get(p.node)
        if record is None:
            return None
        groups = ", ".join(record.groups) or "a budget"
        return Drop(
            Reason.POWER_BUDGET, f"{p.node} is under {groups}: the controller sets its limits"
        )
