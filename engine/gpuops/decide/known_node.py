"""Stage: act only on hosts the inventory knows."""

from __future__ import annotations

from gpuops.decide.stage import BaseStage, Drop, Proposal
from gpuops.inventory.hosts import Inventory
from gpuops.models import Reason


class KnownNode(BaseStage):
    """Drops matches about nodes that are not in the inventory."""

    name = "inventory"

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory

    async def check(self, p: Proposal) -> Drop | None:
        if p.node in self.inventory:
            return None
        return Drop(Reason.UNKNOWN_NODE, f"{p.node!r} is not in {self.inventory.path}")
