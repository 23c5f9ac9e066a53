"""Stage: after a rule fires for a group key, it stays quiet for the rule's cooldown.

The last firing per (rule, key) is kept in KV so a restarted engine, or a second
replica, honours cooldowns the first one started.
"""

from __future__ import annotations

import hashlib
import logging

from nats.js.errors import KeyNotFoundError
from nats.js.kv import KeyValue

from engine.decide.stage import Drop
from engine.match.durations import format_duration
from engine.match.rules import Rule
from engine.models import Match, Reason

log = logging.getLogger(__name__)


def _kv_key(rule: str, key: str) -> str:
    return hashlib.sha256(f"{rule}|{key}".encode()).hexdigest()[:40]


class Cooldown:
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
        try:
            entry = await self.kv.get(_kv_key(rule, key))
            value = float(entry.value.decode()) if entry.value else float("-inf")
        except KeyNotFoundError:
            value = float("-inf")
        self.last[(rule, key)] = value
        return value

    async def check(self, match: Match, rule: Rule, now: float) -> Drop | None:
        if rule.cooldown_s <= 0:
            return None
        last = await self._last(rule.name, match.key)
        if now - last >= rule.cooldown_s:
            return None
        left = rule.cooldown_s - (now - last)
        return Drop(
            Reason.COOLDOWN, f"{format_duration(left)} of {format_duration(rule.cooldown_s)} left"
        )

    async def accepted(self, match: Match, rule: Rule, now: float) -> None:
        if rule.cooldown_s <= 0:
            return
        self.last[(rule.name, match.key)] = now
        if self.kv is not None:
            await self.kv.put(_kv_key(rule.name, match.key), repr(now).encode())
