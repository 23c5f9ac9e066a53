"""Stage: budgets per failure domain. However few nodes the fleet breaker has counted, no
more nodes of one rack, PDU, cooling loop, leaf switch or NVLink domain may lose capacity
within the window than that kind's budget allows (settings `safety.domain_budgets`):
faults on many nodes of one domain at once are usually the domain's (a loop that lost
flow, a PDU), and remediating them node by node would empty it.

What counts is what the breaker counts (the catalogue's `breaker: true`). Each domain
keeps its recent entries in the control bucket under `domain.<kind>.<name>`, changed with
compare-and-set, so partitions and replicas deciding at once never pass more than the
budget together. A drop names the domain and its budget, and hands the fault to a person.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence

from pydantic import BaseModel, ConfigDict

from gpuops.bus.store import CAS_TRIES, KV, Read, Store, contended
from gpuops.catalog import Catalog
from gpuops.decide.breaker import Entry
from gpuops.decide.stage import BaseStage, Drop, Proposal
from gpuops.errors import BusError
from gpuops.inventory.domains import Domains
from gpuops.match.durations import format_duration
from gpuops.models import Reason


class DomainRecord(BaseModel):
    """The nodes of one domain that lost capacity recently."""

    model_config = ConfigDict(frozen=True)

    entries: tuple[Entry, ...] = ()

    def recent(self, now: float, window: float) -> set[str]:
        """Nodes counted within the window."""
        return {e.node for e in self.entries if now - e.at <= window}


def domain_store(kv: KV) -> Store[DomainRecord]:
    """The domains' records in the control bucket."""
    return Store(kv, DomainRecord, "domain")


class DomainBudgets(BaseStage):
    """Counts each node into every budgeted domain it is in; drops past a domain's budget."""

    name = "domain_budget"

    def __init__(
        self,
        kv: KV,
        catalog: Catalog,
        domains: Domains,
        budgets: Mapping[str, Callable[[int], int]],
        window_s: float = 600.0,
    ) -> None:
        self.store = domain_store(kv)
        self.catalog = catalog
        self.domains = domains
        self.budgets = budgets  # kind -> a domain's limit, given its size
        self.window_s = window_s

    def _mine(self, p: Proposal) -> list[tuple[str, str]]:
        """The budgeted domains the proposal's node is in, (kind, name), when it counts."""
        if not (p.acts and self.catalog.counts_for_breaker(a.playbook for a in p.actions)):
            return []
        return [(k, n) for k, n in self.domains.of_node(p.node).items() if k in self.budgets]

    def reads(self, p: Proposal) -> Sequence[Read]:
        return tuple(self.store.read(kind, name) for kind, name in self._mine(p))

    async def check(self, p: Proposal) -> Drop | None:
        """Enter the node in each of its domains in turn; the first over budget drops it,
        and the entries made before it are taken back (`abort`)."""
        try:
            for kind, name in self._mine(p):
                drop = await self._enter(p, kind, name)
                if drop is not None:
                    await self.abort(p)
                    return drop
        except Exception:
            # A record that does not decode, or the bus gone: the decider drops (or retries)
            # without this stage's abort, so the entries made in this loop go back here.
            with contextlib.suppress(Exception):
                await self.abort(p)
            raise
        return None

    async def _enter(self, p: Proposal, kind: str, name: str) -> Drop | None:
        found, rev = await p.reads.get(self.store, kind, name)
        limit = self.budgets[kind](self.domains.size(kind, name))
        for lost in range(CAS_TRIES):
            state = found or DomainRecord()
            recent = state.recent(p.now, self.window_s)
            if p.node in recent:
                return None
            if len(recent) + 1 > limit:
                return Drop(Reason.DOMAIN_BUDGET, self._why(kind, name, recent, limit))
            if await p.reads.cas(self.store, self._entered(state, p), rev, kind, name):
                return None
            await contended(lost)  # another decision came first
            found, rev = await self.store.get(kind, name)
        raise BusError(f"{kind} {name}: too many concurrent changes; the event is decided again")

    def _why(self, kind: str, name: str, recent: set[str], limit: int) -> str:
        size = self.domains.size(kind, name)
        return (
            f"{kind} {name}: {len(recent)} of its {size} nodes lost capacity within "
            f"{format_duration(self.window_s)} ({', '.join(sorted(recent))}); its budget is "
            f"{limit}: a fault on more of one {kind} at once is the {kind}'s, for a person"
        )

    def _entered(self, state: DomainRecord, p: Proposal) -> DomainRecord:
        kept = tuple(e for e in state.entries if p.now - e.at <= self.window_s)
        return DomainRecord(entries=(*kept, Entry(node=p.node, at=p.now, event_id=p.event_id)))

    async def abort(self, p: Proposal) -> None:
        def leave(state: DomainRecord | None) -> DomainRecord | None:
            if state is None:
                return None
            kept = tuple(
                e for e in state.entries if not (e.node == p.node and e.event_id == p.event_id)
            )
            return None if kept == state.entries else DomainRecord(entries=kept)

        for kind, name in self._mine(p):
            await self.store.update(leave, kind, name, known=p.reads.known(self.store, kind, name))

    async def commit(self, p: Proposal) -> None:
        def enter(state: DomainRecord | None) -> DomainRecord | None:
            current = state or DomainRecord()
            if p.node in current.recent(p.now, self.window_s):
                return None  # counted at check (or by an earlier decision on it)
            return self._entered(current, p)

        for kind, name in self._mine(p):
            known = p.reads.known(self.store, kind, name)
            await self.store.update(enter, kind, name, known=known)
