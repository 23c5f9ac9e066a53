"""The record stage: what follows a decision or a run, written down and told.

For each decision: the audit record, the node's state, an approval record when one is
held for a person, and its episode (which tells people once, grouped: episodes.py and
outbox.py). For each run (reported by the executor): the run record, the node's state
and the episode's run times. Nothing here sends work back up the pipeline.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Awaitable
from typing import Any, NamedTuple

from gpuops.bus.store import together
from gpuops.catalog import Catalog
from gpuops.clock import Clock
from gpuops.errors import StateUnreadable
from gpuops.models import AuditRecord, Decision, Intent, Reason, RunOutcome
from gpuops.record import nodestate as ns
from gpuops.record.approvals import ApprovalStore
from gpuops.record.audit import Auditor
from gpuops.record.episodes import Episodes
from gpuops.record.notify import Notifier
from gpuops.record.outbox import Outbox, Tell
from gpuops.record.unreadable import UnreadableState

log = logging.getLogger(__name__)

# A rule held true keeps matching every sample while its cooldown drops it; write the
# first such drop and then one per period with a count, not one record per sample.
REPEAT_PERIOD_S = 60.0


class _Written(NamedTuple):
    """The last record written of a (rule, key, verdict): when, for which event, the
    repeats it reported, the repeats skipped since, and the last of those (when)."""

    at: float
    event_id: str
    reported: int
    since: int
    skipped: tuple[Decision, float] | None = None


def decision_record(
    d: Decision, intents: list[str], at: float, approval: str | None = None, repeats: int = 0
) -> AuditRecord:
    """The audit record of a decision (the executor writes the same one from an intent)."""
    m = d.match
    verdict = "accepted" if d.accepted else f"dropped ({d.reason.value})"
    if approval:
        verdict = f"waiting for approval {approval}"
    plays = ", ".join(a.playbook for a in d.actions) or "no playbook"
    detail = f" [{d.detail}]" if d.detail else ""
    body: dict[str, Any] = {
        "decision": d.model_dump(mode="json", exclude={"match": {"facts"}}),
        "facts": {k: v for k, v in m.facts.items() if v is not None},
        "intents": intents,
        "approval": approval,
        "repeats_suppressed": repeats,
    }
    return AuditRecord(
        type="decision",
        at=at,
        node=m.node,
        rule=m.rule,
        summary=f"{m.rule} on {m.key}: {verdict} -> {plays}{detail}",
        body=body,
    )


def decision_msg_id(d: Decision) -> str:
    """One audit record per decided match and verdict, however often it is decided again
    after a crash. The verdict is part of it because a replay may come out differently: a
    drop recorded just before a crash (its event not acked yet) and the acceptance of the
    same event redelivered once the lock's lease ran out are both true, and the intents
    stored belong to the second; keeping only the first would leave them unexplained.

    The match is hashed, as intent keys are: an event id (200 characters) or a node name
    (253) does not fit whole, and text cut short let one event's decisions on different
    GPUs share an id (JetStream kept the first)."""
    m = d.match
    digest = hashlib.sha256(f"{m.event_id}|{m.rule}|{m.key}".encode()).hexdigest()[:40]
    return f"decision-{d.reason.value}-{digest}"


class Recorder:
    """Audit, node states, approvals and notifications."""

    def __init__(
        self,
        auditor: Auditor,
        states: ns.NodeStates,
        approvals: ApprovalStore,
        catalog: Catalog,
        notifier: Notifier,
        clock: Clock,
        episodes: Episodes,
        outbox: Outbox,
        approval_timeout_s: float = 1800.0,
        validation_timeout_s: float = 900.0,
        unreadable: UnreadableState | None = None,
    ) -> None:
        self.auditor = auditor
        self.unreadable = unreadable or UnreadableState()
        self.states = states
        self.approvals = approvals
        self.catalog = catalog
        self.notifier = notifier
        self.clock = clock
        self.episodes = episodes
        self.outbox = outbox
        self.approval_timeout_s = approval_timeout_s
        self.validation_timeout_s = validation_timeout_s
        self._repeats: dict[tuple[str, str, str], _Written] = {}

    async def decided(self, d: Decision, intents: list[Intent]) -> None:
        """Everything that follows one decision.

        The node's state, the episode and the audit record are separate records, each
        written once however often the decision is replayed, so they go together.
        """
        if d.reason is Reason.NOT_APPLICABLE:
            return
        now, m = self.clock.now(), d.match
        approval = await self._hold(d) if d.reason is Reason.APPROVAL_PENDING else None
        writes: list[Awaitable[object]] = []
        if d.reason is not Reason.STATE_UNREADABLE:  # the audit only: its state is unread
            writes += [
                self._or_told(
                    self.states.apply(m.node, lambda r: ns.after_decision(r, d, self.catalog, now))
                ),
                # Opened at its event's time, so it has the name its intents carry.
                self._or_told(self.episodes.decided(d, m.event_ts if intents else None)),
            ]
        repeats = self._repeated(d, now)
        if repeats is not None:
            record = decision_record(d, [i.key for i in intents], now, approval, repeats)
            writes.append(self.auditor.write(record, decision_msg_id(d)))
        await together(*writes)
        self.outbox.flush(now, inhibited=self.episodes.node_level)

    async def _or_told(self, write: Awaitable[object]) -> None:
        """A write that reads its record first; an unreadable record is told and left
        as it is (a person repairs it), and the decision's audit record still goes out."""
        try:
            await write
        except StateUnreadable as exc:
            self.unreadable.note(exc)

    async def _hold(self, d: Decision) -> str:
        record, opened = await self.approvals.open(d, self.clock.now(), self.approval_timeout_s)
        if opened:  # people are asked once, however often the decision is made again
            self.notifier.notify(
                "approval needed",
                f"{record.id}: {record.summary} ({d.detail}); "
                f"answer `approve {record.id}` or `deny {record.id}`",
            )
        return record.id

    async def cleared(self, rule: str, node: str, gpu: int | None, at: float) -> None:
        """A rule's condition went false on a key that had fired: the fault may be over."""
        await self.episodes.cleared(rule, node, gpu, at)

    def flush(self, force: bool = False) -> None:
        """Send the grouped notifications that are due (`force`: all, at shutdown)."""
        self.outbox.flush(self.clock.now(), force, self.episodes.node_level)

    def _tell_node(self, topic: str, node: str, rule: str, text: str) -> None:
        self.outbox.add(Tell(topic, rule, node, "node", text), self.clock.now())

    def _repeated(self, d: Decision, now: float) -> int | None:
        """None to skip the record (a repeat within the period), else repeats since the last."""
        if d.accepted or d.reason is Reason.APPROVAL_PENDING:
            return 0
        slot, event = (d.match.rule, d.match.key, d.reason.value), d.match.event_id
        last = self._repeats.get(slot)
        if last is not None and last.event_id == event:
            # The same decision again (its write failed, or its event came back): its
            # record again, with the same count; the audit stores it once, by its id.
            return last.reported
        if last is not None and now - last.at < REPEAT_PERIOD_S:
            self._repeats[slot] = last._replace(since=last.since + 1, skipped=(d, now))
            return None
        reported = last.since if last is not None else 0
        self._repeats[slot] = _Written(now, event, reported, 0)
        return reported

    async def run_started(self, intent: Intent) -> None:
        """A playbook began on the node (its decision applied first, if not yet: the
        executor may start before the engine has recorded the decision)."""
        now, play, d = self.clock.now(), intent.action.playbook, intent.decision

        def step(r: ns.NodeRecord) -> ns.NodeRecord | None:
            decided = ns.after_decision(r, d, self.catalog, now) if d is not None else None
            return ns.after_run_started(decided or r, play, now) or decided

        await self.states.apply(intent.node, step)
        await self.episodes.run_started(intent)

    async def run_ended(self, intent: Intent, outcome: RunOutcome) -> ns.NodeRecord:
        """The run record and the node's next state; the node's record after it."""
        await self.auditor.write(
            AuditRecord(
                type="run",
                at=self.clock.now(),
                node=intent.node,
                rule=intent.rule,
                summary=f"{outcome.playbook} {outcome.status.value} rc={outcome.rc} "
                f"in {outcome.duration_s:.1f}s"
                + (f": {outcome.grade.summary()}" if outcome.grade else "")
                + (f": {outcome.error}" if outcome.error and not outcome.grade else ""),
                body=outcome.model_dump(mode="json"),
            ),
            f"run-{intent.key}",
        )
        now, play = self.clock.now(), intent.action.playbook

        def step(r: ns.NodeRecord) -> ns.NodeRecord | None:
            return ns.after_run(
                r,
                play,
                outcome.status,
                self.catalog,
                intent.rule,
                now,
                outcome.error,
                outcome.held_by_person,
                gated=intent.decision is not None and intent.decision.gate > 0,
            )

        moved = await self.states.apply(intent.node, step)
        await self.episodes.run_ended(intent, outcome)
        if moved is not None and moved.state is ns.NodeState.NEEDS_HUMAN:
            self._tell_node("needs-human", intent.node, intent.rule, f"{intent.node}: {moved.why}")
        elif outcome.status.value != "successful":
            why = f"{play} on {intent.node}: {outcome.status.value} (rc={outcome.rc})"
            self._tell_node("run failed", intent.node, intent.rule, why)
        self.flush()
        return moved or await self.states.get(intent.node)

    async def sweep(self) -> None:
        """Nodes whose validation probe never came go to a person; old repeat slots go."""
        now = self.clock.now()
        for record in await self.states.all():
            if record.state is not ns.NodeState.VALIDATING:
                continue
            moved = await self.states.apply(
                record.node, lambda r: ns.after_silence(r, now, self.validation_timeout_s)
            )
            if moved is not None:
                self._tell_node(
                    "needs-human", moved.node, "validation", f"{moved.node}: {moved.why}"
                )
                await self.auditor.note(now, moved.node, f"{moved.node}: {moved.why}")
        await self.episodes.sweep()
        self.flush()
        for slot in [s for s, w in self._repeats.items() if now - w.at > REPEAT_PERIOD_S]:
            await self._write_skipped(self._repeats[slot])
            del self._repeats[slot]

    async def _write_skipped(self, written: _Written) -> None:
        """The last repeat a slot skipped, recorded with the count of the others: the
        next record of the slot would have carried them, and the slot is going."""
        if written.skipped is None:
            return
        d, at = written.skipped
        record = decision_record(d, [], at, None, written.since - 1)
        await self.auditor.write(record, decision_msg_id(d))
