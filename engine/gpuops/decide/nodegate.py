"""Stages about who asked and where the node is: built-in rules that apply only in some
node states (validation), that hand the node to a person, or that a person triggered.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpuops.bus.store import Read, Store
from gpuops.decide.lock import NodeLocks
from gpuops.decide.stage import BaseStage, Drop, Proposal
from gpuops.diagnose.fabric import pick_peers
from gpuops.errors import StateUnreadable
from gpuops.inventory.domains import FACILITY, Domains
from gpuops.inventory.hosts import Inventory
from gpuops.match.expr import render
from gpuops.match.loader import gated_timeout_s
from gpuops.models import ActionSpec, Reason
from gpuops.record.episodes import Episode
from gpuops.record.nodestate import (
    NodeRecord,
    NodeState,
    NodeStates,
    decision_cause,
    validation_nonce,
)


class NodeStateGate(BaseStage):
    """Lets a rule that names node states through only while the node is in one of them;
    a return to service it lets through runs the gate the node's fault asked for (its
    record's grade) when that is deeper than the rule's."""

    name = "node_state"

    def __init__(self, states: NodeStates, returning: str = "") -> None:
        self.states = states
        self.returning = returning  # the catalogue's return playbook

    def reads(self, p: Proposal) -> Sequence[Read]:
        return (self.states.store.read(p.node),) if p.rule.states else ()

    async def check(self, p: Proposal) -> Drop | None:
        if not p.rule.states:
            return None
        found, _ = await p.reads.get(self.states.store, p.node)
        record = found or NodeRecord(node=p.node)
        # A decision made again (its first try failed on the bus after its intent was
        # stored, or the event came back after a crash) finds the node as its own first
        # try left it (a run of its intent may have begun): it is this decision still.
        again = record.cause == decision_cause(p.match)
        if record.state.value not in p.rule.states and not again:
            return Drop(Reason.NOT_APPLICABLE, f"{p.node} is {record.state.value}")
        answers = p.match.facts.get("nonce") == validation_nonce(record)
        if record.state is NodeState.VALIDATING and p.match.kind == "probe" and not answers:
            why = f"{p.node}: this probe does not answer the validation's request (nonce)"
            return Drop(Reason.NOT_APPLICABLE, why)
        if record.grade:
            p.actions = [self._gated(a, record.grade, p) for a in p.actions]
        return None

    def _gated(self, action: ActionSpec, grade: int, p: Proposal) -> ActionSpec:
        """The return with the gate at `grade` at least (the fault's: `gate` of its rule)."""
        asked = int(action.vars.get("grade") or 0)
        if action.playbook != self.returning or asked >= grade:
            return action
        p.notes.append(f"the gate runs grade {grade}, as {p.node}'s fault asked")
        timeout = max(action.timeout_s, gated_timeout_s(grade))  # a grade 3 takes up to 90m
        return action.model_copy(
            update={"vars": {**action.vars, "grade": grade}, "timeout_s": timeout}
        )


class NodeReadable(BaseStage):
    """Nothing acts on a node whose state record does not decode: whatever would act
    reads it (gpuops.errors.StateUnreadable stops the proposal), though its rule names
    no state. Placed after the cooldown, so what a running cooldown drops reads nothing.
    """

    name = "node_record"

    def __init__(self, states: NodeStates) -> None:
        self.states = states

    def reads(self, p: Proposal) -> Sequence[Read]:
        return (self.states.store.read(p.node),) if p.acts else ()

    async def check(self, p: Proposal) -> Drop | None:
        if p.acts:
            await p.reads.get(self.states.store, p.node)
        return None


# The grades that load every GPU (gpuops.diagnose) and that the gate back into service can
# run (return_to_service.yml: 1 to 3); grade 4 pairs with peers and runs only on a node
# already out.
DRAINED_GRADES = (2, 3)


class DrainForGrade(BaseStage):
    """A grade that loads every GPU (`diagnose: 2` or `3`) asked for a node in service
    runs as the gate after a drain: the action becomes the catalogue's drain with the
    decision's gate at that grade, so the node is drained (counted by the breaker, its
    lock held), validated, and returned by the gate only when the grade passes; a failed
    grade keeps it out and climbs the rule's ladder or goes to a person (the gate's
    rules). On a node already out, the grade runs as asked."""

    name = "drain_for_grade"

    def __init__(self, states: NodeStates, diagnosing: str, isolating: str) -> None:
        self.states, self.diagnosing, self.isolating = states, diagnosing, isolating

    def _grade(self, action: ActionSpec) -> int:
        if action.playbook != self.diagnosing:
            return 0
        grade = str(action.vars.get("grade"))
        return int(grade) if grade.isdigit() and int(grade) in DRAINED_GRADES else 0

    def reads(self, p: Proposal) -> Sequence[Read]:
        return (self.states.store.read(p.node),) if p.acts else ()

    async def check(self, p: Proposal) -> Drop | None:
        grades = [self._grade(a) for a in p.actions] if p.acts else []
        if not any(grades):
            return None
        found, _ = await p.reads.get(self.states.store, p.node)
        # Out of service already, the grade runs there; out by this very decision (it is
        # decided again after a crash), it is still the drain it was.
        if found is not None and found.quarantined and found.cause != decision_cause(p.match):
            return None
        grade = max(grades)
        reason = next(
            (a.vars.get("reason") for a in p.actions if self._grade(a) and a.vars.get("reason")),
            f"grade {grade} diagnostics ({p.rule.name})",
        )
        drain = ActionSpec(playbook=self.isolating, vars={"reason": reason}, timeout_s=1800.0)
        p.actions = [drain, *(a for a, g in zip(p.actions, grades, strict=True) if not g)]
        p.gate = max(p.gate, grade)
        p.notes.append(f"{p.node} is in service: drained first, grade {grade} is the gate back")
        return None


class EpisodeName(BaseStage):
    """An acting proposal names the episode it remediates (Slurm's drain reason shows it):
    the rule's open episode on the node, read with the node's record; none open, the
    decision opens one and the pipeline names it. Never a drop: an episode record that
    does not decode leaves the name to the new one, and the recorder tells of it."""

    name = "episode"

    def __init__(self, episodes: Store[Episode]) -> None:
        self.episodes = episodes

    def reads(self, p: Proposal) -> Sequence[Read]:
        return (self.episodes.read(p.rule.name, p.node),) if p.acts else ()

    async def check(self, p: Proposal) -> Drop | None:
        if not p.acts:
            return None
        try:
            found, _ = await p.reads.get(self.episodes, p.rule.name, p.node)
        except StateUnreadable:
            return None
        if found is not None and found.resolved_at is None:
            p.episode = found.id
        return None


class Escalate(BaseStage):
    """A rule marked `escalate` hands the node to a person instead of acting."""

    name = "escalate"

    async def check(self, p: Proposal) -> Drop | None:
        if not p.rule.escalate:
            return None
        return Drop(Reason.NEEDS_HUMAN, str(render(p.rule.description, p.match.facts)))


class FabricPeers(BaseStage):
    """A grade-4 diagnosis (the fabric) runs against known-good peers the engine picks:
    in none of the node's failure domains (rack, leaf switch, PDU, cooling loop), not out
    of service or under remediation (every node not healthy in the state records, and
    every node locked now), two of them for the second pass (gpuops.diagnose.fabric). A
    rule that names `peers` keeps its own. None to be had: the run's verdict says so and
    fails. Either way the peers are held with the node (`Proposal.peers`: NodeLock takes
    their locks) so nothing remediates one mid-test."""

    name = "fabric_peers"

    def __init__(
        self,
        states: NodeStates,
        inventory: Inventory,
        diagnosing: str,
        domains: Domains | None = None,
        locks: NodeLocks | None = None,
    ) -> None:
        self.states, self.inventory, self.diagnosing = states, inventory, diagnosing
        self.domains = (domains or Domains.of(inventory)).by_node
        self.locks = locks

    def _fabric(self, action: ActionSpec) -> bool:
        return action.playbook == self.diagnosing and str(action.vars.get("grade")) == "4"

    async def check(self, p: Proposal) -> Drop | None:
        fabric = [a for a in p.actions if self._fabric(a)] if p.acts else []
        if not fabric:
            return None
        if any(not a.vars.get("peers") for a in fabric):
            peers = await self._pick(p)
            p.actions = [
                a.model_copy(update={"vars": {**a.vars, "peers": peers}})
                if self._fabric(a) and not a.vars.get("peers")
                else a
                for a in p.actions
            ]
            p.notes.append(f"fabric peers: {', '.join(peers) or 'none known-good'}")
        # Each with its peers now, as a list of the inventory's hosts (a rule's own may be
        # written "a, b"): what the playbook pairs with is what is locked.
        p.actions = [
            a.model_copy(update={"vars": {**a.vars, "peers": self._hosts(a.vars["peers"], p)}})
            if self._fabric(a)
            else a
            for a in p.actions
        ]
        named = (n for a in p.actions if self._fabric(a) for n in a.vars["peers"])
        p.peers = tuple(dict.fromkeys(named))
        return None

    def _hosts(self, given: object, p: Proposal) -> list[str]:
        names = given.split(",") if isinstance(given, str) else given
        if not isinstance(names, list | tuple):
            names = []
        hosts = [str(n).strip() for n in names]
        known = [h for h in hosts if h in self.inventory.hosts and h != p.node]
        if len(known) < len(hosts):
            gone = sorted(set(hosts) - set(known))
            p.notes.append(f"fabric peers left out (not in the inventory, or the node): {gone}")
        return list(dict.fromkeys(known))

    async def _pick(self, p: Proposal) -> list[str]:
        out = {r.node for r in await self.states.all() if r.state is not NodeState.HEALTHY}
        if self.locks is not None:
            # Not the peers this event's decision locked on a try before (its intent
            # stored with them): picked again, they would stay locked, unused, a lease long.
            out |= await self.locks.held(p.now, but=p.match.event_id)
        hosts = sorted(self.inventory.hosts - self.inventory.group_hosts(FACILITY))
        return pick_peers(p.node, hosts, self.domains, out)
