"""Stage: after a rule fires for a group key, it stays quiet for the rule's cooldown.

A rule that acts once per node (`consolidate: node`) cools down per node, for the GPUs
it acted on: when its playbooks act per GPU (catalogue `per_gpu`), a GPU of that node
that joins the fault later is not held back by the others' cooldown, and the proposal is
narrowed to the GPUs not yet covered; a node-wide playbook (a drain) already covered it.

The last firing per (rule, key) is kept in KV, so a restarted engine or a second
replica honours cooldowns the first one started. Reads go to KV; only a cooldown known
to be running is cached, since no replica can shorten one (a firing only moves it on).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from gpuops.bus.store import KV, Read, Store
from gpuops.catalog import Catalog
from gpuops.decide.stage import BaseStage, Drop, Proposal
from gpuops.match.durations import format_duration
from gpuops.models import GATE_KIND, Reason


class Firing(BaseModel):
    """When a rule last fired for a key, and on which event."""

    model_config = ConfigDict(frozen=True)

    at: float
    event_id: str = ""
    # For a rule that acts once per node: which event acted on each GPU (index as text),
    # so a redelivered event is decided as it was the first time.
    covered: dict[str, str] = {}


CACHE_LIMIT = 10_000


@functools.lru_cache(maxsize=1 << 14)  # asked by every stage's look at the reads
def _digest(rule: str, key: str) -> str:
    return hashlib.sha256(f"{rule}|{key}".encode()).hexdigest()[:40]


class Cooldown(BaseStage):
    """Drops a match while its rule and group key are cooling down."""

    name = "cooldown"

    def __init__(self, kv: KV, catalog: Catalog) -> None:
        self.catalog = catalog
        self.store: Store[Firing] = Store(kv, Firing, "cooldown")
        self._running: dict[str, tuple[Firing, float]] = {}  # digest -> (firing, ends)

    def _cached(self, digest: str, now: float) -> Firing | None:
        """The firing of a cooldown known to be running at `now`."""
        cached = self._running.get(digest)
        if cached is not None and now < cached[1]:
            return cached[0]
        self._running.pop(digest, None)
        return None

    def reads(self, p: Proposal) -> Sequence[Read]:
        digest = _digest(p.rule.name, p.match.key)
        if p.rule.cooldown_s <= 0 or self._cached(digest, p.now) is not None:
            return ()
        return (self.store.read(digest),)

    async def _last(self, p: Proposal, digest: str) -> Firing | None:
        cached = self._cached(digest, p.now)
        if cached is not None:
            return cached
        found, _ = await p.reads.get(self.store, digest)
        if found is not None and p.now - found.at < p.rule.cooldown_s:
            self._remember(digest, found, found.at + p.rule.cooldown_s, p.now)
        return found

    def _remember(self, digest: str, firing: Firing, ends: float, now: float) -> None:
        """Cache a running cooldown; past CACHE_LIMIT entries, ended ones are dropped."""
        self._running[digest] = (firing, ends)
        if len(self._running) > CACHE_LIMIT:
            for d in [d for d, (_, end) in self._running.items() if end <= now]:
                del self._running[d]

    async def check(self, p: Proposal) -> Drop | None:
        cooldown = p.rule.cooldown_s
        if cooldown <= 0 or p.match.kind == GATE_KIND:
            return None  # a failed gate continues the fix the cooldown let through
        last = await self._last(p, _digest(p.rule.name, p.match.key))
        if last is None or p.now - last.at >= cooldown:
            return None
        mine = tuple(g for g in p.match.gpus if last.covered.get(str(g), p.event_id) == p.event_id)
        if last.covered and mine and (last.event_id == p.event_id or self._per_gpu(p)):
            if mine != p.match.gpus:  # only the GPUs no other event acted on
                gpu = mine[0] if len(mine) == 1 else None
                p.match = p.match.model_copy(update={"gpus": mine, "gpu": gpu})
            return None
        if last.event_id == p.event_id:
            return None  # the same event decided again (after a crash): the same answer
        left = cooldown - (p.now - last.at)
        return Drop(Reason.COOLDOWN, f"{format_duration(left)} of {format_duration(cooldown)} left")

    def _per_gpu(self, p: Proposal) -> bool:
        """Whether every action acts on the listed GPUs only (a drain or reboot covers the
        node: a GPU joining later is already covered)."""
        specs = [self.catalog.get(a.playbook) for a in p.actions]
        return bool(specs) and all(s is not None and s.per_gpu for s in specs)

    async def commit(self, p: Proposal) -> None:
        if p.rule.cooldown_s <= 0:
            return
        digest = _digest(p.rule.name, p.match.key)
        covered: dict[str, str] = {}
        if p.rule.consolidate:
            last = await self._last(p, digest)
            if last is not None and p.now - last.at < p.rule.cooldown_s:
                covered = dict(last.covered)
            covered.update({str(g): p.event_id for g in p.match.gpus})
        firing = Firing(at=p.now, event_id=p.event_id, covered=covered)
        self._remember(digest, firing, p.now + p.rule.cooldown_s, p.now)
        await self.store.put(firing, digest)
