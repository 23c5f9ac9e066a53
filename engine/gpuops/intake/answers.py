"""People's answers to held decisions come back in as input: an approved match is handed
to the pipeline's entry again (a `Request`, approved), so it passes the lock, the breaker
and every stage at the moment it would run; an approval nobody answered in time is a
deny.
"""

from __future__ import annotations

from collections.abc import Callable

from gpuops.clock import Clock
from gpuops.models import Decide, Decision, Request
from gpuops.record.approvals import ApprovalStatus, ApprovalStore
from gpuops.record.recorder import Recorder


class Answers:
    """Settles the approvals people answered (or did not answer in time)."""

    def __init__(
        self,
        approvals: ApprovalStore,
        decide: Decide,
        owns: Callable[[str], bool],
        recorder: Recorder,
        clock: Clock,
    ) -> None:
        self.approvals, self.decide, self.owns = approvals, decide, owns
        self.recorder, self.clock = recorder, clock

    async def settle(self) -> list[Decision]:
        """Decide approved matches again; expire the unanswered ones. The decisions made."""
        now, auditor, notifier = self.clock.now(), self.recorder.auditor, self.recorder.notifier
        made: list[Decision] = []
        for record in await self.approvals.all():
            if not self.owns(record.node):
                continue  # the replica that owns the node's partition settles it
            if record.status is ApprovalStatus.APPROVED:
                # Decide first, then mark: a crash in between decides again, which is
                # idempotent by the held match's event id (same intents, same keys).
                request = Request(match=record.match, approved_by=record.by or "someone")
                decisions = await self.decide(request)
                made += decisions
                await self.approvals.mark(record, ApprovalStatus.EXECUTED)
                verdict = decisions[0].reason.value if decisions else "rule no longer loaded"
                await auditor.note(
                    now,
                    record.node,
                    f"approval {record.id} by {record.by}: decided again -> {verdict}",
                    {"approval": record.id},  # the decision's own record lists its intents
                )
            elif (
                record.status is ApprovalStatus.PENDING
                and now >= record.expires
                and await self.approvals.mark(record, ApprovalStatus.EXPIRED)
            ):
                notifier.notify("approval expired", f"{record.id}: {record.summary} (denied)")
                await auditor.note(now, record.node, f"approval {record.id} expired: denied")
        return made
