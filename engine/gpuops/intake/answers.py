"""People's answers to held decisions come back in as input: an approved match is handed
to the pipeline's entry again (a `Request`, approved), so it passes the lock, the breaker
and every stage at the moment it would run; an approval nobody answered in time is a
deny.
"""

from __future__ import annotations

from collections.abc import Callable

from gpuops.clock import Clock
from gpuops.models import Decide, Decision, Request
from gpuops.record.approvals import SETTLED_KEPT_S, ApprovalRecord, ApprovalStatus, ApprovalStore
from gpuops.record.recorder import Recorder


class Answers:
    """Settles the approvals people answered (or did not answer in time).

    A settled approval (denied, expired, executed) never changes again: a tick reads
    only the others, and remembers the settled ones (with the revision read) until it
    deletes them, SETTLED_KEPT_S after their window closed; a record written since that
    revision is kept and read again. So a tick lists the keys and reads what can change.
    """

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
        self._settled: dict[str, tuple[float, int]] = {}  # id: (deleted after, revision)

    async def settle(self) -> list[Decision]:
        """Decide approved matches again; expire the unanswered ones. The decisions made."""
        now = self.clock.now()
        ids = await self.approvals.ids()
        listed = set(ids)
        # A record deleted elsewhere (another replica) may be opened again: read it then.
        self._settled = {i: s for i, s in self._settled.items() if i in listed}
        made: list[Decision] = []
        for record, revision in await self.approvals.read(i for i in ids if i not in self._settled):
            if record.settled:
                self._settled[record.id] = (record.expires + SETTLED_KEPT_S, revision)
            elif self.owns(record.node):  # the replica that owns the node's partition
                made += await self._answered(record, now)
        await self._delete_due(now)
        return made

    async def _delete_due(self, now: float) -> None:
        """Delete the settled records kept long enough, each only if unchanged since it
        was read (one written since is forgotten here, so the next tick reads it)."""
        due = [(i, rev) for i, (after, rev) in self._settled.items() if now >= after]
        for approval_id, revision in due:
            await self.approvals.remove(approval_id, revision)
            self._settled.pop(approval_id, None)  # a tick beside this one may have, too

    async def _answered(self, record: ApprovalRecord, now: float) -> list[Decision]:
        """An approved record decided again, or an unanswered one past its time expired."""
        auditor, notifier = self.recorder.auditor, self.recorder.notifier
        if record.status is ApprovalStatus.APPROVED:
            # Decide first, then mark: a crash in between decides again, which is
            # idempotent by the held match's event id (same intents, same keys).
            request = Request(match=record.match, approved_by=record.by or "someone")
            decisions = await self.decide(request)
            await self.approvals.mark(record, ApprovalStatus.EXECUTED)
            verdict = decisions[0].reason.value if decisions else "rule no longer loaded"
            await auditor.note(
                now,
                record.node,
                f"approval {record.id} by {record.by}: decided again -> {verdict}",
                {"approval": record.id},  # the decision's own record lists its intents
            )
            return decisions
        if (
            record.status is ApprovalStatus.PENDING
            and now >= record.expires
            and await self.approvals.mark(record, ApprovalStatus.EXPIRED)
        ):
            notifier.notify("approval expired", f"{record.id}: {record.summary} (denied)")
            await auditor.note(now, record.node, f"approval {record.id} expired: denied")
        return []
