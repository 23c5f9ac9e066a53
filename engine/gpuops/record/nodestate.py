"""The node state machine, kept in KV so every replica and the CLI see the same fleet.

    healthy -> suspect -> quarantined -> remediating -> validating -> healthy
              any state -> needs_human (cap reached, ladder ended, validation failed,
                                         a fix that took the node out failed)

Transitions are pure functions of a record and what happened (`after_decision`,
`after_run`, `after_silence`); `NodeStates` applies them with compare-and-set.
`quarantined` says the node was taken out of service, so a successful remediation is
followed by validation before it returns.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Iterable
from enum import StrEnum

from pydantic import BaseModel, ConfigDict

from gpuops.bus.store import KV, Store
from gpuops.catalog import Catalog, Effect
from gpuops.models import Decision, Match, Reason, RunStatus


class NodeState(StrEnum):
    """Where a node is in its remediation."""

    HEALTHY = "healthy"
    SUSPECT = "suspect"
    QUARANTINED = "quarantined"
    REMEDIATING = "remediating"
    VALIDATING = "validating"
    NEEDS_HUMAN = "needs_human"


S = NodeState
ALLOWED: dict[NodeState, frozenset[NodeState]] = {
    S.HEALTHY: frozenset({S.SUSPECT, S.QUARANTINED, S.REMEDIATING, S.NEEDS_HUMAN}),
    S.SUSPECT: frozenset({S.HEALTHY, S.QUARANTINED, S.REMEDIATING, S.NEEDS_HUMAN}),
    S.QUARANTINED: frozenset({S.REMEDIATING, S.NEEDS_HUMAN, S.HEALTHY}),
    S.REMEDIATING: frozenset({S.VALIDATING, S.HEALTHY, S.SUSPECT, S.QUARANTINED, S.NEEDS_HUMAN}),
    S.VALIDATING: frozenset({S.HEALTHY, S.NEEDS_HUMAN, S.REMEDIATING, S.QUARANTINED}),
    # Only a person brings a node back from here (undrain runs return_to_service).
    S.NEEDS_HUMAN: frozenset({S.REMEDIATING, S.HEALTHY}),
}


class NodeRecord(BaseModel):
    """One node's state, why it is there, and since when."""

    model_config = ConfigDict(frozen=True)

    node: str
    state: NodeState = NodeState.HEALTHY
    since: float = 0.0
    why: str = ""
    rule: str = ""  # the rule whose decision put the node here (its fault)
    quarantined: bool = False
    previous: NodeState | None = None
    # The last decision applied: the same decision (made again after a crash, or seen
    # first by the executor through its intent) never moves the node twice.
    cause: str = ""
    # The grade of diagnostics the gate back into service runs for the fault that took
    # the node out (its rule's `gate`; 0: safety.validation_grade alone).
    grade: int = 0


def validation_nonce(record: NodeRecord) -> str:
    """The nonce of a node's validation: its request carries it, its answer must echo it,
    so only the probe asked for this validation (not a scheduled one, nor an old pass
    kept in the stream) returns the node to service. Made of the node and the decision
    that took it out, so the executor that asks, the engine that checks and a replay of
    the recording agree on it without storing it."""
    digest = hashlib.sha256(f"validation|{record.node}|{record.cause}".encode())
    return digest.hexdigest()[:32]


def fault_key(record: NodeRecord) -> str:
    """The group key of the decision that took the node out (its cause
    `decision:RULE:KEY:EVENT`), "" when no decision did."""
    if not record.cause.startswith("decision:"):
        return ""
    rest = record.cause.removeprefix("decision:").split(":", 1)[-1]
    return rest.rsplit(":", 1)[0] if ":" in rest else ""


def moved(
    record: NodeRecord,
    to: NodeState,
    why: str,
    at: float,
    quarantined: bool | None = None,
    cause: str = "",
    rule: str = "",
    grade: int | None = None,
) -> NodeRecord | None:
    """The record after moving to `to`, or None when the machine does not allow it (or
    `cause` already moved it: a decision made again after a crash changes nothing). A
    new decision on a node already out (a failed gate's next rung) is recorded as its
    cause, in the same state."""
    if cause and cause == record.cause:
        return None
    if record.state is not to and to not in ALLOWED[record.state]:
        return None
    flag = record.quarantined if quarantined is None else quarantined
    if record.state is to and record.quarantined == flag and not (cause and to is S.QUARANTINED):
        return None
    if grade is None:  # the fault's gate holds until the node is back
        grade = 0 if to is S.HEALTHY else record.grade
    return NodeRecord(
        node=record.node,
        state=to,
        since=at,
        why=why,
        rule=rule or record.rule,
        quarantined=flag,
        previous=record.state,
        cause=cause or record.cause,
        grade=grade,
    )


def decision_cause(m: Match) -> str:
    """How a node's record names the decision that moved it."""
    return f"decision:{m.rule}:{m.key}:{m.event_id}"


def after_decision(
    record: NodeRecord, d: Decision, catalog: Catalog, at: float
) -> NodeRecord | None:
    """What a decision does to the node's state."""
    m, rule = d.match, d.match.rule
    plays = [a.playbook for a in d.actions]
    if d.reason in (Reason.NEEDS_HUMAN, Reason.ATTEMPT_CAP):
        return moved(record, S.NEEDS_HUMAN, d.detail, at, cause=decision_cause(m), rule=rule)
    if d.accepted and catalog.takes_out(plays):
        out, cause = S.QUARANTINED, decision_cause(m)
        doing = _doing(m, plays)
        return moved(record, out, doing, at, quarantined=True, cause=cause, rule=rule, grade=d.gate)
    # Most decisions leave the node where it is (a fault seen again): the texts of a move
    # are made only for one.
    if record.state is not S.HEALTHY:
        return None
    returning = any((s := catalog.get(p)) is not None and s.effect is Effect.RETURN for p in plays)
    if d.accepted and not returning:
        return moved(record, S.SUSPECT, _doing(m, plays), at, rule=rule)
    if d.reason is Reason.NO_ACTION:
        return moved(record, S.SUSPECT, _fault(m), at, rule=rule)
    return None


def _fault(m: Match) -> str:
    return fault_name(m.rule, m.gpus or ((m.gpu,) if m.gpu is not None else ()))


def _doing(m: Match, plays: list[str]) -> str:
    """What the node's record says is being done about the fault."""
    return f"{_fault(m)}: {', '.join(plays)}" if plays else _fault(m)


def gpu_names(gpus: Iterable[int]) -> str:
    """ "GPU 3", "GPUs 1,4", or "" for none."""
    found = sorted(set(gpus))
    if not found:
        return ""
    return ("GPU " if len(found) == 1 else "GPUs ") + ",".join(map(str, found))


def fault_name(rule: str, gpus: Iterable[int]) -> str:
    """A rule's fault as people name it: the rule and the GPUs it is about."""
    named = gpu_names(gpus)
    return f"{rule} on {named}" if named else rule


def after_run_started(record: NodeRecord, playbook: str, at: float) -> NodeRecord | None:
    """A playbook began on the node."""
    return moved(record, S.REMEDIATING, f"{playbook} running", at)


def after_run(
    record: NodeRecord,
    playbook: str,
    status: RunStatus,
    catalog: Catalog,
    rule: str,
    at: float,
    error: str | None = None,
    held_by_person: str | None = None,
    gated: bool = False,
) -> NodeRecord | None:
    """Validate a node that was taken out; return others to healthy; a failure steps back,
    or, for a fix that took the node out, goes to a person with what failed. `gated`: the
    run's decision named a gate (a drain for a grade: decide.nodegate.DrainForGrade)."""
    spec = catalog.get(playbook)
    if status is RunStatus.INTERRUPTED:
        why = f"{playbook} was interrupted (engine or executor died mid-run): check the node"
        return moved(record, S.NEEDS_HUMAN, why, at)
    if status is not RunStatus.SUCCESSFUL and held_by_person is not None:
        # A person drained the node for their own reason; gpuops acts no further on it.
        return moved(record, S.NEEDS_HUMAN, f"{playbook} {status.value}: {error}", at)
    if status is not RunStatus.SUCCESSFUL and record.quarantined and spec and spec.validate_after:
        # Drained and not fixed (its work would not leave, the GPU did not come back): no
        # probe follows and nothing else returns it to service, so a person must look.
        why = f"{playbook} {status.value}" + (f": {error}" if error else "")
        return moved(record, S.NEEDS_HUMAN, why, at)
    if status is not RunStatus.SUCCESSFUL:
        back = S.QUARANTINED if record.quarantined else S.SUSPECT
        why = f"{playbook} {status.value}" + (f": {error}" if error else "")
        return moved(record, back, why, at)
    if spec is not None and spec.effect is Effect.ISOLATE and gated and record.grade:
        # Drained for a grade of diagnostics (decide.nodegate.DrainForGrade): the gate
        # back into service runs it, after the probe. The decision's own gate says so, not
        # a grade left on the record (a person's drain of a node a failed gate left out
        # stays a person's).
        return moved(record, S.VALIDATING, f"{playbook} succeeded; grade {record.grade} next", at)
    if spec is not None and spec.effect is Effect.ISOLATE:
        why = f"drained after {rule}: fix the cause, then undrain {record.node}"
        return moved(record, S.NEEDS_HUMAN, why, at, quarantined=True)
    if spec is not None and spec.effect is Effect.RETURN:
        return moved(record, S.HEALTHY, "probe passed; returned to service", at, quarantined=False)
    if record.quarantined and spec is not None and spec.validate_after:
        return moved(record, S.VALIDATING, f"{playbook} succeeded; probing", at)
    return moved(record, S.HEALTHY, f"{playbook} succeeded", at)


def after_gate_failed(record: NodeRecord, summary: str, grade: int, at: float) -> NodeRecord | None:
    """A node whose gate failed is out of service, as its failed return left it: what a
    replay applies when the recording tells it (its own simulated return succeeded)."""
    why = f"the gate back into service failed: {summary}"
    return moved(record, S.QUARANTINED, why, at, quarantined=True, grade=grade)


def after_silence(record: NodeRecord, at: float, limit_s: float) -> NodeRecord | None:
    """A node under validation whose probe never answered goes to a person."""
    if record.state is not S.VALIDATING or at - record.since <= limit_s:
        return None
    why = f"no validation probe answer within {limit_s:.0f}s of {record.why.split(';')[0]}"
    return moved(record, S.NEEDS_HUMAN, why, at)


def node_counts(records: Iterable[NodeRecord], hosts: Collection[str]) -> dict[str, int]:
    """Nodes of `hosts` per state (every state listed); a node never recorded is healthy."""
    counts = dict.fromkeys((s.value for s in NodeState), 0)
    recorded = 0
    for record in records:
        if record.node in hosts:
            counts[record.state.value] += 1
            recorded += 1
    counts[NodeState.HEALTHY.value] += len(hosts) - recorded
    return counts


Transition = Callable[[NodeRecord], "NodeRecord | None"]


class NodeStates:
    """Reads node records and applies transitions with compare-and-set."""

    def __init__(self, kv: KV) -> None:
        self.store: Store[NodeRecord] = Store(kv, NodeRecord, "state")

    async def get(self, node: str) -> NodeRecord:
        """A node's record; healthy when never written."""
        value, _ = await self.store.get(node)
        return value or NodeRecord(node=node)

    async def apply(self, node: str, change: Transition) -> NodeRecord | None:
        """Apply a transition (retrying on a concurrent write); the new record, if it moved."""
        result: list[NodeRecord] = []

        def step(current: NodeRecord | None) -> NodeRecord | None:
            new = change(current or NodeRecord(node=node))
            result[:] = [new] if new is not None else []
            return new

        await self.store.update(step, node)
        return result[0] if result else None

    async def all(self) -> list[NodeRecord]:
        """Every node that ever left healthy, with its current record; one that does not
        decode is left out (the gate reads each node's own record, strictly, before
        anything acts on it; `gpuops status` names the rest)."""
        found, _ = await self.store.readable()
        return [r for _, r in found]
