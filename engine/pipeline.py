"""One event through match, decide, intent and record, in that order.

The event handed in is acked by the intake only after `handle` returns, and `handle`
returns only after every intent is stored in the actions queue and every decision is
in the audit stream, so a crash at any point loses nothing.
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from typing import Any

from nats.js import JetStreamContext

from engine.clock import Clock
from engine.decide.stage import Decider
from engine.inventory import Inventory
from engine.match.matcher import Matcher
from engine.models import (
    AuditRecord,
    Decision,
    Event,
    Intent,
    Match,
    ProbeEvent,
    Reason,
    action_subject,
)
from engine.record.audit import Auditor
from engine.record.lifecycle import Lifecycle

log = logging.getLogger(__name__)

# A rule held true keeps matching every sample while its cooldown drops it; write the
# first such drop and then one per period with a count, not one record per sample.
REPEAT_PERIOD_S = 60.0


def intent_key(rule: str, key: str, event_id: str, playbook: str) -> str:
    """The idempotency key of one action: rule, group key, triggering event, playbook."""
    return hashlib.sha256(f"{rule}|{key}|{event_id}|{playbook}".encode()).hexdigest()[:40]


async def publish_intent(js: JetStreamContext, intent: Intent) -> None:
    """Store an intent in the actions work queue (deduplicated by its key); await the store."""
    await js.publish(
        action_subject(intent.node),
        intent.model_dump_json().encode(),
        headers={"Nats-Msg-Id": intent.key},
    )


class Pipeline:
    """Match, decide, write intents, record."""

    def __init__(
        self,
        matcher: Matcher,
        decider: Decider,
        auditor: Auditor,
        js: JetStreamContext,
        clock: Clock,
        inventory: Inventory,
        lifecycle: Lifecycle | None = None,
    ) -> None:
        self.matcher = matcher
        self.decider = decider
        self.auditor = auditor
        self.js = js
        self.clock = clock
        self.inventory = inventory
        self.lifecycle = lifecycle
        self.events: Counter[str] = Counter()
        self.matches: Counter[str] = Counter()
        self.decisions: Counter[str] = Counter()
        self.intents = 0
        self._repeats: dict[tuple[str, str, str], tuple[float, int]] = {}
        self._unknown_seen: dict[str, float] = {}

    async def handle(self, event: Event) -> None:
        """Everything the engine does with one event."""
        self.events[event.kind] += 1
        if event.node not in self.inventory:
            await self._unknown_node(event)
        elif isinstance(event, ProbeEvent) and self.lifecycle is not None:
            follow = await self.lifecycle.probed(event)
            if follow is not None:
                await self.write_intent(follow)
                await self.auditor.note(
                    self.clock.now(),
                    follow.node,
                    f"probe passed: {follow.action.playbook} for {follow.node}",
                    {"intent": follow.key, "rule": follow.rule},
                )
        for match in self.matcher.match(event):
            await self.handle_match(match)

    async def tick(self) -> None:
        """Matches that come from silence rather than from an event."""
        for match in self.matcher.tick(self.clock.now()):
            await self.handle_match(match)

    async def handle_match(self, match: Match) -> None:
        """Decide one match, write its intents, record the decision."""
        rule = self.matcher.rules.get(match.rule)
        if rule is None:
            return
        self.matches[match.rule] += 1
        decision = await self.decider.decide(match, rule)
        self.decisions[decision.reason.value] += 1
        intents = [self._intent(decision, i) for i in range(len(decision.actions))]
        if decision.accepted:
            for intent in intents:
                await self.write_intent(intent)
        approval = None
        if self.lifecycle is not None:
            approval = await self.lifecycle.decided(decision, intents)
        written = intents if decision.accepted else []
        await self._record(decision, written, approval)

    async def write_intent(self, intent: Intent) -> None:
        """Store an intent in the actions work queue, and count it."""
        await publish_intent(self.js, intent)
        self.intents += 1

    def _intent(self, decision: Decision, index: int) -> Intent:
        m, action = decision.match, decision.actions[index]
        return Intent(
            key=intent_key(m.rule, m.key, m.event_id, action.playbook),
            rule=m.rule,
            node=m.node,
            gpu=m.gpu,
            action=action,
            event_id=m.event_id,
            event_ts=m.event_ts,
            decided_at=self.clock.now(),
        )

    async def _record(
        self, decision: Decision, intents: list[Intent], approval: str | None
    ) -> None:
        m = decision.match
        repeats = 0
        if not decision.accepted and decision.reason is not Reason.APPROVAL_PENDING:
            slot = (m.rule, m.key, decision.reason.value)
            last, count = self._repeats.get(slot, (float("-inf"), 0))
            if self.clock.now() - last < REPEAT_PERIOD_S:
                self._repeats[slot] = (last, count + 1)
                return
            self._repeats[slot] = (self.clock.now(), 0)
            repeats = count
        verdict = "accepted" if decision.accepted else f"dropped ({decision.reason.value})"
        if approval:
            verdict = f"waiting for approval {approval}"
        plays = ", ".join(a.playbook for a in decision.actions) or "no playbook"
        detail = f" [{decision.detail}]" if decision.detail else ""
        body: dict[str, Any] = {
            "decision": decision.model_dump(mode="json", exclude={"match": {"facts"}}),
            "facts": {k: v for k, v in m.facts.items() if v is not None},
            "intents": [i.key for i in intents],
            "approval": approval,
            "repeats_suppressed": repeats,
        }
        await self.auditor.write(
            AuditRecord(
                type="decision",
                at=self.clock.now(),
                node=m.node,
                rule=m.rule,
                summary=f"{m.rule} on {m.key}: {verdict} -> {plays}{detail}",
                body=body,
            )
        )

    async def _unknown_node(self, event: Event) -> None:
        """Record, at most hourly per node, that a host outside the inventory is reporting."""
        now = self.clock.now()
        if now - self._unknown_seen.get(event.node, float("-inf")) < 3600:
            return
        self._unknown_seen[event.node] = now
        log.warning("event from %s, which is not in the inventory: never acted upon", event.node)
        await self.auditor.note(
            self.clock.now(),
            event.node,
            f"{event.node} is not in the inventory; its events are never acted upon",
            {"event_id": event.id, "kind": event.kind},
        )
