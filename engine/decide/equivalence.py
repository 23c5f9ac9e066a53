"""Stage: a reboot (or reprovision) in progress or done recently supersedes a GPU reset.

Accepted actions are remembered per node; a lighter action on a node that a heavier
one just covered is dropped as superseded (the heavier one resets every GPU anyway).
"""

from __future__ import annotations

from nats.js.kv import KeyValue

from engine.bus.kvjson import get_json, kv_key, put_json
from engine.decide.stage import BaseStage, Drop, Proposal
from engine.effects import NODE_WIDE, WEIGHT
from engine.match.durations import format_duration
from engine.models import Reason


class Equivalence(BaseStage):
    """Drops a lighter remediation when a heavier one ran on the node within `window_s`."""

    name = "equivalence"

    def __init__(self, kv: KeyValue | None, window_s: float = 1800.0) -> None:
        self.kv = kv
        self.window_s = window_s
        self.recent: dict[str, tuple[float, str]] = {}

    async def _recent(self, node: str) -> tuple[float, str] | None:
        if node in self.recent or self.kv is None:
            return self.recent.get(node)
        value, _ = await get_json(self.kv, kv_key("heavy", node))
        if value is not None:
            self.recent[node] = (float(value[0]), str(value[1]))
        return self.recent.get(node)

    async def check(self, p: Proposal) -> Drop | None:
        weight = max((WEIGHT.get(a.playbook, 0) for a in p.actions), default=0)
        if weight == 0:
            return None
        recent = await self._recent(p.node)
        if recent is None or p.now - recent[0] > self.window_s:
            return None
        at, playbook = recent
        done = WEIGHT.get(playbook, 0)
        # A node-wide action (reboot, reprovision) covers anything as heavy or lighter;
        # a GPU reset covers only its own GPU, which the cooldown already handles.
        if done > weight or (done == weight and weight >= NODE_WIDE):
            ago = format_duration(p.now - at)
            return Drop(Reason.SUPERSEDED, f"{playbook} on {p.node} {ago} ago covers this")
        return None

    async def commit(self, p: Proposal) -> None:
        heavy = max(p.actions, key=lambda a: WEIGHT.get(a.playbook, 0), default=None)
        if heavy is None or WEIGHT.get(heavy.playbook, 0) == 0 or p.dry_run:
            return
        self.recent[p.node] = (p.now, heavy.playbook)
        if self.kv is not None:
            await put_json(self.kv, kv_key("heavy", p.node), [p.now, heavy.playbook])
