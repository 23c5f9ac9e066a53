"""Stage: after a rule fires for a group key, it stays quiet for the rule's cooldown.

The last firing per (rule, key) is kept in KV, so a restarted engine or a second
replica honours cooldowns the first one started.
"""

from __future__ import annotations

import hashlib

from nats.js.kv import KeyValue

from engine.bus.kvjson import get_json, put_json
from engine.decide.stage import BaseStage, Drop, Proposal
from engine.match.durations import format_duration
from engine.models import Reason


def _kv_key(rule: str, key: str) -> str:
    return hashlib.sha256(f"{rule}|{key}".encode()).hexdigest()[:40]


class Cooldown(BaseStage):
    """Drops a match while its rule and group key are cooling down."""

    name = "cooldown"

    def __init__(self, kv: KeyValue | None = None) -> None:
        self.kv = kv
        self.last: dict[tuple[str, str], float] = {}

    async def _last(self, rule: str, key: str) -> float:
        """The last firing, from this process's cache or, the first time, from KV."""
        cached = self.last.get((rule, key))
        if cached is not None or self.kv is None:
            return cached if cached is not None else float("-inf")
        value, _ = await get_json(self.kv, _kv_key(rule, key))
        found = float(value) if value is not None else float("-inf")
        self.last[(rule, key)] = found
        return found

    async def check(self, p: Proposal) -> Drop | None:
        cooldown = p.rule.cooldown_s
        if cooldown <= 0:
            return None
        last = await self._last(p.rule.name, p.match.key)
        if p.now - last >= cooldown:
            return None
        left = cooldown - (p.now - last)
        return Drop(Reason.COOLDOWN, f"{format_duration(left)} of {format_duration(cooldown)} left")

    async def commit(self, p: Proposal) -> None:
        if p.rule.cooldown_s <= 0:
            return
        self.last[(p.rule.name, p.match.key)] = p.now
        if self.kv is not None:
            await put_json(self.kv, _kv_key(p.rule.name, p.match.key), p.now)
