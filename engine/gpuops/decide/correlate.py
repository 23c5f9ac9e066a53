"""Stage: domain correlation. A rule with `domain:` (gpu-overheat by cooling loop) treats its
fault on many nodes of one failure domain at once as the domain's: one domain episode
instead of N node episodes, the node remediations held while the domain's response runs
(a power budget on the domain's nodes through the power controller, people told), and
only the nodes whose fault outlives the domain's recovery remediated one by one.

Each node's fault waits `within` for its domain's others (`domain_wait`): a loop that
lost flow heats its nodes over tens of seconds, and draining the first would drain them
all. When `nodes` of the domain fault within `within`, the episode opens and holds every
node's fault for `hold` (`domain_held`). A fault that outlasts the hold, or that no other
node joined, is the node's own and goes on through the stages. The record of each rule
and domain is in the control bucket (`correlate.<rule>.<kind>.<name>`), changed with
compare-and-set, so replicas see one episode; `applied` says the response was made, so a
crash between opening the episode and applying its response applies it on the next fault.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from pydantic import BaseModel, ConfigDict

from gpuops.bus.store import CAS_TRIES, KV, Read, Store, contended
from gpuops.decide.stage import BaseStage, Drop, Proposal
from gpuops.errors import BusError
from gpuops.inventory.domains import Domains
from gpuops.match.durations import format_duration
from gpuops.match.rules import DomainRule
from gpuops.models import Reason


class DomainFaults(BaseModel):
    """One rule's fault over one domain: who faults since when, and its episode if open."""

    model_config = ConfigDict(frozen=True)

    seen: dict[str, tuple[float, float]] = {}  # node -> (first, last) fault time
    opened: float | None = None  # the domain episode's start
    until: float = 0.0  # node remediations held until then
    nodes: tuple[str, ...] = ()  # the nodes that opened it
    applied: bool = False  # the domain's response was made
    # The last episode's end: a fault first seen before it is its node's own, and only
    # faults first seen after it gather towards the next episode.
    since: float = 0.0


class DomainEpisode(BaseModel):
    """What the domain's response acts on (the power budget, the notification)."""

    model_config = ConfigDict(frozen=True)

    rule: str
    kind: str
    name: str
    group: str  # how the power controller and people name the domain
    members: tuple[str, ...]  # every node of the domain
    faulting: tuple[str, ...]  # the nodes whose faults opened it
    opened: float
    until: float
    power_share: float | None = None


OnOpen = Callable[[DomainEpisode], Awaitable[None]]


def correlation_store(kv: KV) -> Store[DomainFaults]:
    """The domains' fault records in the control bucket."""
    return Store(kv, DomainFaults, "correlate")


class DomainCorrelation(BaseStage):
    """Holds a `domain:` rule's node faults while their domain's episode gathers or holds."""

    name = "domain_correlation"

    def __init__(self, kv: KV, domains: Domains, on_open: OnOpen) -> None:
        self.store = correlation_store(kv)
        self.domains = domains
        self.on_open = on_open

    def _domain(self, p: Proposal) -> tuple[DomainRule, str] | None:
        spec = p.rule.domain
        # A ladder rule has no playbook yet: the ladder picks it after this stage.
        if spec is None or not (p.acts or p.rule.ladder is not None):
            return None
        name = self.domains.of_node(p.node).get(spec.kind)
        return (spec, name) if name is not None else None

    def reads(self, p: Proposal) -> Sequence[Read]:
        found = self._domain(p)
        return () if found is None else (self.store.read(p.rule.name, found[0].kind, found[1]),)

    async def check(self, p: Proposal) -> Drop | None:
        found = self._domain(p)
        if found is None:
            return None
        spec, name = found
        key = (p.rule.name, spec.kind, name)
        current, rev = await p.reads.get(self.store, *key)
        for lost in range(CAS_TRIES):
            record = current or DomainFaults()
            new, drop = self._step(record, p, spec, name)
            if new == record or await p.reads.cas(self.store, new, rev, *key):
                if new.opened is not None and not new.applied and p.now < new.until:
                    await self._apply(new, p, spec, name, key)
                return drop
            await contended(lost)  # another decision came first
            current, rev = await self.store.get(*key)
        raise BusError(f"{spec.kind} {name}: too many concurrent changes; decided again later")

    def _step(
        self, record: DomainFaults, p: Proposal, spec: DomainRule, name: str
    ) -> tuple[DomainFaults, Drop | None]:
        """The record with this node's fault in it, and the proposal's fate."""
        now, node, within = p.now, p.node, spec.within_s
        seen = {n: fl for n, fl in record.seen.items() if now - fl[1] <= within}
        if record.opened is not None and now >= record.until:
            # The episode ended. A node that kept faulting through it (its drain refused,
            # waiting for a person) must not keep the domain from ever opening another.
            record = DomainFaults(since=record.until)
        first, last = seen.get(node, (now, float("-inf")))
        # Writes only as often as they matter: a node seen again within a quarter window.
        if now - last >= within / 4:
            seen[node] = (first, now)
        where = f"{spec.kind} {name}"
        if record.opened is not None and now < record.until:
            new = record.model_copy(update={"seen": seen})
            return new, Drop(Reason.DOMAIN_HELD, self._held(record, where))
        if first < record.since:  # the domain recovered; this node's fault outlived it
            p.notes.append(f"{where}'s episode ended: the fault outlived it, the node's own")
            return record.model_copy(update={"seen": seen}), None
        gathering = sorted(n for n, (f, _) in seen.items() if f >= record.since)
        if len(gathering) >= spec.nodes:
            opened = DomainFaults(
                seen=seen, opened=now, until=now + spec.hold_s, nodes=tuple(gathering)
            )
            return opened, Drop(Reason.DOMAIN_HELD, "opened: " + self._held(opened, where))
        if now - first < within:
            wait = (
                f"waiting up to {format_duration(within)} for {where}'s other nodes: "
                f"{len(gathering)} of {spec.nodes} faulting"
            )
            return record.model_copy(update={"seen": seen}), Drop(Reason.DOMAIN_WAIT, wait)
        p.notes.append(f"no other node of {where} joined within {format_duration(within)}")
        return record.model_copy(update={"seen": seen}), None

    @staticmethod
    def _held(record: DomainFaults, where: str) -> str:
        return (
            f"the domain episode of {where} ({len(record.nodes)} nodes: "
            f"{', '.join(record.nodes)}) holds node remediations for "
            f"{format_duration(record.until - (record.opened or 0.0))}: the domain's response first"
        )

    async def _apply(
        self,
        record: DomainFaults,
        p: Proposal,
        spec: DomainRule,
        name: str,
        key: tuple[str, str, str],
    ) -> None:
        """The domain's response, then `applied` (once; a crash before it: the next fault)."""
        episode = DomainEpisode(
            rule=p.rule.name,
            kind=spec.kind,
            name=name,
            group=self.domains.group(spec.kind, name),
            members=tuple(sorted(self.domains.members.get((spec.kind, name), ()))),
            faulting=record.nodes,
            opened=record.opened or p.now,
            until=record.until,
            power_share=spec.power_share,
        )
        await self.on_open(episode)

        def mark(current: DomainFaults | None) -> DomainFaults | None:
            if current is None or current.opened != record.opened or current.applied:
                return None
            return current.model_copy(update={"applied": True})

        await self.store.update(mark, *key)
