"""People's answers to held decisions come back in as input: an approved match is decided
again (approved), so it passes the lock, the breaker and every stage at the moment it
would run; an approval nobody answered in time is a deny.
"""

from __future__ import annotations

from gpuops.clock import Clock
from gpuops.record.approvals import ApprovalStatus, ApprovalStore
from gpuops.spine.pipeline import Pipeline


async def settle_approvals(approvals: ApprovalStore, pipeline: Pipeline, clock: Clock) -> None:
    """Decide approved matches again; expire the unanswered ones."""
    now, auditor, notifier = clock.now(), pipeline.auditor, pipeline.recorder.notifier
    for record in await approvals.all():
        if not pipeline.owns(record.node):
            continue  # the replica that owns the node's partition settles it
        if record.status is ApprovalStatus.APPROVED:
            # Decide first, then mark: a crash in between decides again, which is
            # idempotent by the held match's event id (same intents, same keys).
            d = await pipeline.handle_match(record.match, approved_by=record.by or "someone")
            await approvals.mark(record, ApprovalStatus.EXECUTED)
            verdict = "rule no longer loaded" if d is None else d.reason.value
            await auditor.note(
                now,
                record.node,
                f"approval {record.id} by {record.by}: decided again -> {verdict}",
                {"approval": record.id},  # the decision's own record lists its intents
            )
        elif (
            record.status is ApprovalStatus.PENDING
            and now >= record.expires
            and await approvals.mark(record, ApprovalStatus.EXPIRED)
        ):
            notifier.notify("approval expired", f"{record.id}: {record.summary} (denied)")
            await auditor.note(now, record.node, f"approval {record.id} expired: denied")
