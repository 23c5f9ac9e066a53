"""Stage: at most N remediations per node in a window (default 5 in 7 days), then a person.

The count lives in KV, so it survives restarts and is shared by replicas.
"""

from __future__ import annotations

from nats.js.kv import KeyValue

from engine.bus.kvjson import get_json, kv_key, put_json
from engine.decide.stage import BaseStage, Drop, Proposal
from engine.match.durations import format_duration
from engine.models import Reason


class AttemptCap(BaseStage):
    """Drops remediations on a node that has had `cap` of them within `window_s`."""

    name = "attempt_cap"

    def __init__(self, kv: KeyValue | None, cap: int = 5, window_s: float = 7 * 86400.0) -> None:
        self.kv = kv
        self.cap = cap
        self.window_s = window_s
        self.memory: dict[str, list[float]] = {}

    async def attempts(self, node: str, now: float) -> list[float]:
        """Times of the node's remediations within the window."""
        key = kv_key("attempts", node)
        if self.kv is None:
            stored = self.memory.get(key, [])
        else:
            value, _ = await get_json(self.kv, key)
            stored = value or []
        return [t for t in stored if now - t <= self.window_s]

    async def check(self, p: Proposal) -> Drop | None:
        if not p.actions:
            return None
        done = await self.attempts(p.node, p.now)
        if len(done) < self.cap:
            return None
        return Drop(
            Reason.ATTEMPT_CAP,
            f"{len(done)} remediations on {p.node} within "
            f"{format_duration(self.window_s)} (cap {self.cap}); a person must look at it",
        )

    async def commit(self, p: Proposal) -> None:
        if not p.actions or p.dry_run:
            return
        key = kv_key("attempts", p.node)
        done = [*await self.attempts(p.node, p.now), p.now]
        if self.kv is None:
            self.memory[key] = done
        else:
            await put_json(self.kv, key, done)
