"""What follows a decision or a run: node states, approvals, validation, notifications.

The pipeline and the executor report here; this module moves the node state machine,
opens approval records, asks a remediated node's agent for a probe, and turns a
passing probe into `return_to_service.yml`.
"""

from __future__ import annotations

import logging

from nats.aio.client import Client

from engine.act.notify import Notifier
from engine.clock import Clock
from engine.decide.approval import ApprovalStore
from engine.effects import ISOLATE, RETURN, quarantines
from engine.models import (
    ActionSpec,
    Decision,
    Intent,
    ProbeEvent,
    Reason,
    RunOutcome,
    RunStatus,
    subject_token,
)
from engine.record import nodestate as ns

log = logging.getLogger(__name__)

VALIDATION_RULE = "validation"


class Lifecycle:
    """Keeps the fleet's node states and tells people what they need to know."""

    def __init__(
        self,
        states: ns.NodeStates,
        notifier: Notifier,
        approvals: ApprovalStore,
        nc: Client,
        clock: Clock,
        approval_timeout_s: float = 1800.0,
    ) -> None:
        self.states = states
        self.notifier = notifier
        self.approvals = approvals
        self.nc = nc
        self.clock = clock
        self.approval_timeout_s = approval_timeout_s

    async def decided(self, decision: Decision, intents: list[Intent]) -> str | None:
        """After a decision is recorded; returns the approval id when one was opened."""
        m, reason, now = decision.match, decision.reason, self.clock.now()
        plays = ", ".join(a.playbook for a in decision.actions) or "nothing"
        if reason is Reason.APPROVAL_PENDING:
            return await self._ask(decision, intents, plays)
        if reason in (Reason.NEEDS_HUMAN, Reason.ATTEMPT_CAP):
            await self.states.move(m.node, ns.NEEDS_HUMAN, decision.detail, now)
            self.notifier.notify("needs-human", f"{m.node}: {decision.detail} (rule {m.rule})")
        elif decision.accepted:
            quarantine = quarantines([a.playbook for a in decision.actions])
            if quarantine:
                await self.states.move(
                    m.node, ns.QUARANTINED, f"{m.rule}: {plays}", now, quarantined=True
                )
            else:
                await self.states.move(m.node, ns.SUSPECT, f"{m.rule}: {plays}", now)
        elif reason is Reason.NO_ACTION:
            await self.states.move(m.node, ns.SUSPECT, m.rule, now)
        if decision.notify and reason in (Reason.ACCEPTED, Reason.NO_ACTION):
            self.notifier.notify("incident", f"{m.rule} ({m.severity}) on {m.key}: {plays}")
        return None

    async def _ask(self, decision: Decision, intents: list[Intent], plays: str) -> str:
        m = decision.match
        body = {
            "rule": m.rule,
            "node": m.node,
            "key": m.key,
            "summary": f"{m.rule} on {m.key} would run {plays}",
            "detail": decision.detail,
            "intents": [i.model_dump(mode="json") for i in intents],
            "closes_breaker": "breaker half-open" in decision.detail,
        }
        approval_id = await self.approvals.create(body, self.clock.now(), self.approval_timeout_s)
        self.notifier.notify(
            "approval needed",
            f"{approval_id}: {body['summary']} ({decision.detail}); "
            f"answer `approve {approval_id}` or `deny {approval_id}`",
        )
        return approval_id

    async def run_started(self, intent: Intent) -> None:
        """A playbook began on the node."""
        await self.states.move(
            intent.node, ns.REMEDIATING, f"{intent.action.playbook} running", self.clock.now()
        )

    async def run_ended(self, intent: Intent, outcome: RunOutcome) -> None:
        """Validate a node that was taken out; return others to healthy; note failures."""
        now, node, play = self.clock.now(), intent.node, intent.action.playbook
        record = await self.states.get(node)
        if outcome.status is not RunStatus.SUCCESSFUL:
            back = ns.QUARANTINED if record.get("quarantined") else ns.SUSPECT
            await self.states.move(node, back, f"{play} {outcome.status.value}", now)
            self.notifier.notify(
                "run failed", f"{play} on {node}: {outcome.status.value} (rc={outcome.rc})"
            )
        elif play in ISOLATE:
            why = f"drained after {intent.rule}: fix the cause, then undrain {node}"
            await self.states.move(node, ns.NEEDS_HUMAN, why, now, quarantined=True)
            self.notifier.notify("needs-human", f"{node}: {why}")
        elif play == RETURN:
            await self.states.move(
                node, ns.HEALTHY, "probe passed; returned to service", now, quarantined=False
            )
        elif record.get("quarantined"):
            await self.states.move(node, ns.VALIDATING, f"{play} succeeded; probing", now)
            await self.nc.publish(f"gpuops.agent.{subject_token(node)}.probe", b"validate")
        else:
            await self.states.move(node, ns.HEALTHY, f"{play} succeeded", now)

    async def probed(self, event: ProbeEvent) -> Intent | None:
        """A probe result for a node under validation: pass returns it to service."""
        record = await self.states.get(event.node)
        if record["state"] != ns.VALIDATING:
            return None
        if event.data.outcome == "pass":
            return Intent(
                key=f"validated-{event.id}"[:60],
                rule=VALIDATION_RULE,
                node=event.node,
                action=ActionSpec(playbook=RETURN, vars={"reason": "probe passed"}),
                event_id=event.id,
                event_ts=event.epoch,
                decided_at=self.clock.now(),
            )
        why = f"validation probe {event.data.outcome}: {event.data.error or 'no detail'}"
        await self.states.move(event.node, ns.NEEDS_HUMAN, why, self.clock.now())
        self.notifier.notify("needs-human", f"{event.node}: {why}")
        return None
