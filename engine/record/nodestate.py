"""The node state machine, kept in KV so every replica and the CLI see the same fleet.

    healthy -> suspect -> quarantined -> remediating -> validating -> healthy
              any state -> needs_human (cap reached, ladder ended, validation failed)

`quarantined` in the record says the node was taken out of service (drained), so a
successful remediation is followed by validation before it returns.
"""

from __future__ import annotations

import logging
from typing import Any

from nats.js.kv import KeyValue

from engine.bus.kvjson import cas_json, get_json, keys, kv_key

log = logging.getLogger(__name__)

HEALTHY, SUSPECT, QUARANTINED = "healthy", "suspect", "quarantined"
REMEDIATING, VALIDATING, NEEDS_HUMAN = "remediating", "validating", "needs_human"
STATES = (HEALTHY, SUSPECT, QUARANTINED, REMEDIATING, VALIDATING, NEEDS_HUMAN)

ALLOWED: dict[str, frozenset[str]] = {
    HEALTHY: frozenset({SUSPECT, QUARANTINED, REMEDIATING, NEEDS_HUMAN}),
    SUSPECT: frozenset({HEALTHY, QUARANTINED, REMEDIATING, NEEDS_HUMAN}),
    QUARANTINED: frozenset({REMEDIATING, NEEDS_HUMAN, HEALTHY}),
    REMEDIATING: frozenset({VALIDATING, HEALTHY, SUSPECT, QUARANTINED, NEEDS_HUMAN}),
    VALIDATING: frozenset({HEALTHY, NEEDS_HUMAN, REMEDIATING, QUARANTINED}),
    NEEDS_HUMAN: frozenset({HEALTHY}),  # only a person brings a node back from here
}


class NodeStates:
    """Reads and moves node states with compare-and-set."""

    def __init__(self, kv: KeyValue) -> None:
        self.kv = kv

    async def get(self, node: str) -> dict[str, Any]:
        """A node's record; healthy when never written."""
        value, _ = await get_json(self.kv, kv_key("state", node))
        return value or {
            "node": node,
            "state": HEALTHY,
            "since": 0.0,
            "why": "",
            "quarantined": False,
        }

    async def move(self, node: str, to: str, why: str, at: float, **extra: Any) -> bool:
        """Move `node` to `to` if the machine allows it; False (and a log line) if not."""
        for _ in range(5):
            value, rev = await get_json(self.kv, kv_key("state", node))
            current = value or {"node": node, "state": HEALTHY, "quarantined": False}
            if current["state"] == to and not extra:
                return True
            if current["state"] != to and to not in ALLOWED[current["state"]]:
                log.info("node %s: %s -> %s not allowed (%s)", node, current["state"], to, why)
                return False
            record = {
                **current,
                **extra,
                "node": node,
                "state": to,
                "since": at,
                "why": why,
                "previous": current["state"],
            }
            if await cas_json(self.kv, kv_key("state", node), record, rev):
                return True
        return False

    async def all(self) -> list[dict[str, Any]]:
        """Every node that ever left healthy, with its current record."""
        out = []
        for key in await keys(self.kv, "state."):
            value, _ = await get_json(self.kv, key)
            if value is not None:
                out.append(value)
        return out
