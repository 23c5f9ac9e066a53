"""Stage: silences and maintenance windows, by rule, node, group or label, with expiry.

A silence is `{id, target, starts, ends, reason, by}`; `target` is `rule:NAME`,
`node:NAME`, `group:NAME` (an inventory group) or `label:KEY=VALUE` (an inventory host
variable). A maintenance window is a silence that starts later. They live in the
control bucket under `silence.<id>`, so the CLI, ChatOps and every replica share them.
"""

from __future__ import annotations

import secrets
from typing import Any

from pydantic import BaseModel, ConfigDict

from gpuops.bus.store import KV, Store
from gpuops.decide.stage import BaseStage, Drop, Proposal
from gpuops.errors import ConfigError, StateUnreadable
from gpuops.inventory.hosts import Inventory
from gpuops.match.durations import parse_duration
from gpuops.models import Reason

TARGETS = ("rule", "node", "group", "label")


class Silence(BaseModel):
    """One silence or maintenance window."""

    model_config = ConfigDict(frozen=True)

    id: str
    target: str
    starts: float
    ends: float
    reason: str
    by: str = ""

    def active(self, now: float) -> bool:
        """In force at `now`."""
        return self.starts <= now < self.ends

    def covers(self, rule: str, node: str, inventory: Inventory) -> bool:
        """Whether this silence applies to a match of `rule` on `node`."""
        kind, _, value = self.target.partition(":")
        if kind == "rule":
            return value == rule
        if kind == "node":
            return value == node
        if kind == "group":
            return node in inventory.group_hosts(value)
        key, _, want = value.partition("=")
        hostvars = inventory.hostvars.get(node, {})
        # A host without the variable is not covered (str(None) would match "None").
        return key in hostvars and str(hostvars[key]) == want


def silence_span(args: list[str], now: float) -> tuple[str, float, float, str]:
    """`TARGET DURATION REASON...` as (target, starts, ends, reason) from `now`.

    The `silence` command and replay of a recorded one both read it here, so a replay
    silences exactly what the person silenced. ValueError says what is missing or wrong.
    """
    if len(args) < 3:
        raise ValueError("missing arguments")
    return args[0], now, now + parse_duration(args[1]), " ".join(args[2:])


def parse_target(target: str) -> str:
    """Check `kind:value`; raise ConfigError saying the accepted forms."""
    kind, sep, value = target.partition(":")
    if not sep or kind not in TARGETS or not value or (kind == "label" and "=" not in value):
        raise ConfigError(
            f"silence target {target!r}: use rule:NAME, node:NAME, group:NAME or label:KEY=VALUE"
        )
    return target


class SilenceStore:
    """Silences in the control bucket."""

    def __init__(self, kv: KV) -> None:
        self.store: Store[Silence] = Store(kv, Silence, "silence")

    async def add(
        self, target: str, starts: float, ends: float, reason: str, by: str = ""
    ) -> Silence:
        """Create a silence; returns it with its id."""
        silence = Silence(
            id=secrets.token_hex(4),
            target=parse_target(target),
            starts=starts,
            ends=ends,
            reason=reason,
            by=by,
        )
        await self.store.put(silence, silence.id)
        return silence

    async def remove(self, silence_id: str) -> bool:
        """Delete a silence; False if there was none with that id."""
        value, _ = await self.store.get(silence_id)
        if value is None:
            return False
        await self.store.delete(silence_id)
        return True

    async def all(self) -> list[Silence]:
        """Every stored silence, expired ones included."""
        return [s for _, s in await self.store.all()]


class Silences(BaseStage):
    """Drops matches that a silence in force covers."""

    name = "silence"

    def __init__(self, store: SilenceStore, inventory: Inventory, refresh_s: float = 2.0) -> None:
        self.store = store
        self.inventory = inventory
        self.refresh_s = refresh_s
        self._cache: list[Silence] | StateUnreadable = []
        self._read_at = float("-inf")

    async def _current(self, now: float) -> list[Silence]:
        # Read the bucket at most every few seconds: silences change by hand, not per event.
        # A silence that does not decode is kept as the answer as long (every proposal
        # stops on it), not listed again for each one.
        if now - self._read_at >= self.refresh_s or now < self._read_at:
            try:
                self._cache = await self.store.all()
            except StateUnreadable as exc:
                self._cache = exc
            self._read_at = now
        if isinstance(self._cache, StateUnreadable):
            raise self._cache
        return self._cache

    async def check(self, p: Proposal) -> Drop | None:
        if p.rule.by_person:
            return None  # a silence quiets automation, not a person's own command
        for s in await self._current(p.now):
            if s.active(p.now) and s.covers(p.rule.name, p.node, self.inventory):
                return Drop(Reason.SILENCED, f"silence {s.id} ({s.target}): {s.reason}")
        return None


def silence_dict(s: Silence) -> dict[str, Any]:
    """A silence for JSON output."""
    return s.model_dump()
