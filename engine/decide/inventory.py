"""Stage: act only on hosts the inventory knows."""

from __future__ import annotations

from engine.decide.stage import Drop
from engine.inventory import Inventory
from engine.match.rules import Rule
from engine.models import Match, Reason


class KnownNode:
    """Drops matches about nodes that are not in the inventory."""

    name = "inventory"

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory

    async def check(self, match: Match, rule: Rule, now: float) -> Drop | None:
        if match.node in self.inventory:
            return None
        return Drop(Reason.UNKNOWN_NODE, f"{match.node!r} is not in {self.inventory.path}")

    async def accepted(self, match: Match, rule: Rule, now: float) -> None:
        return None
