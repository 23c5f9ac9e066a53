"""`gpuops replay`: a JSON-lines file of recorded events through the shadow pipeline."""

from __future__ import annotations

import logging
from pathlib import Path

from gpuops.errors import EventError
from gpuops.intake.decode import decode
from gpuops.inventory.hosts import load_inventory
from gpuops.match.rules import RuleSet
from gpuops.settings import Settings
from gpuops.spine.shadow import Shadow, WouldRun

log = logging.getLogger(__name__)


async def replay_file(
    path: Path, rules: RuleSet, inventory: Path | None, settings: Settings | None = None
) -> tuple[list[WouldRun], dict[str, int]]:
    """Would-be actions, in event order, and counts of events read and unreadable."""
    _, actions, stats = await replay(path, rules, inventory, settings)
    return actions, stats


async def replay(
    path: Path, rules: RuleSet, inventory: Path | None, settings: Settings | None = None
) -> tuple[Shadow, list[WouldRun], dict[str, int]]:
    """The shadow engine after the recording, its would-be actions, and the counts."""
    nodes = load_inventory(inventory).hosts if inventory is not None else _nodes_in(path)
    # Recorded events are old by now: replay judges them at their own time, never stale.
    base = settings or Settings()
    safety = base.safety.model_copy(update={"stale_after_s": float("inf")})
    shadow = Shadow(rules, nodes, base.model_copy(update={"safety": safety}))
    actions: list[WouldRun] = []
    stats = {"events": 0, "bad": 0}
    with path.open("rb") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                event = decode(line)
            except EventError as exc:
                stats["bad"] += 1
                log.warning("%s:%d: skipped (%s)", path, number, exc)
                continue
            stats["events"] += 1
            actions += await shadow.feed(event)
    return shadow, actions, stats


def _nodes_in(path: Path) -> set[str]:
    """With no inventory, every node the recording names is taken as known."""
    nodes: set[str] = set()
    with path.open("rb") as lines:
        for line in lines:
            try:
                nodes.add(decode(line).node)
            except EventError:
                continue
    return nodes
