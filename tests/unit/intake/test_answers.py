"""Settled approvals go, pending ones stay: a settled record (denied, expired, executed)
is deleted a day after its window closed, and a tick reads only the records that can
still change; a pending one is kept, read every tick, and can still be approved."""

from __future__ import annotations

import dataclasses

from gpuops.bus.buckets import Buckets
from gpuops.bus.store import Entry, MemoryKV
from gpuops.clock import ManualClock
from gpuops.models import ActionSpec, Decision, Reason
from gpuops.record.approvals import SETTLED_KEPT_S, ApprovalStatus
from gpuops.spine.build import Engine

from tests.unit.decide.helpers import T0, engine_on, match

TIMEOUT_S = 1800.0


class CountedKV(MemoryKV):
    """A memory bucket that counts the records read."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.reads = 0

    async def get(self, key: str) -> Entry | None:
        self.reads += 1
        return await super().get(key)


def _engine(clock: ManualClock) -> tuple[Engine, CountedKV]:
    control = CountedKV("control")
    buckets = dataclasses.replace(Buckets.memory(), control=control)
    return engine_on(clock, buckets=buckets, approval_timeout_s=TIMEOUT_S), control


def _held(node: str, t: float) -> Decision:
    m = match("drift-needs-approval", node=node, t=t, gpu=None, kind="drift")
    return Decision(
        match=m,
        accepted=False,
        reason=Reason.APPROVAL_PENDING,
        actions=(ActionSpec(playbook="baseline.yml"),),
    )


async def test_settled_approvals_are_deleted_after_the_retention_and_pending_ones_kept() -> None:
    clock = ManualClock(T0)
    engine, control = _engine(clock)
    for node in ("node-001", "node-002", "node-003"):
        await engine.recorder.decided(_held(node, clock.now()), [])
    denied, _, executed = sorted(await engine.approvals.all(), key=lambda r: r.node)
    await engine.approvals.decide(denied.id, False, "alice", clock.now())
    await engine.approvals.decide(executed.id, True, "alice", clock.now())
    await engine.answers.settle()  # the approved one is decided again: executed
    clock.advance(TIMEOUT_S + 1)
    await engine.answers.settle()  # the unanswered one expires
    statuses = {r.node: r.status for r in await engine.approvals.all()}
    assert statuses == {
        "node-001": ApprovalStatus.DENIED,
        "node-002": ApprovalStatus.EXPIRED,
        "node-003": ApprovalStatus.EXECUTED,
    }

    await engine.answers.settle()  # reads them once more, settled
    control.reads = 0
    await engine.answers.settle()
    assert control.reads == 0, "a tick reads nothing that cannot change"

    clock.advance(SETTLED_KEPT_S - 10)
    await engine.recorder.decided(_held("node-004", clock.now()), [])
    await engine.answers.settle()
    assert len(await engine.approvals.ids()) == 4, "kept a day after their window closed"
    clock.advance(20)
    control.reads = 0
    await engine.answers.settle()
    assert control.reads == 1, "only the pending one is read"
    [pending] = await engine.approvals.all()
    assert pending.node == "node-004" and pending.status is ApprovalStatus.PENDING

    approved = await engine.approvals.decide(pending.id, True, "bob", clock.now())
    assert approved.status is ApprovalStatus.APPROVED
    await engine.answers.settle()
    done = await engine.approvals.get(pending.id)
    assert done is not None and done.status is ApprovalStatus.EXECUTED


async def test_a_settled_record_written_again_before_its_deletion_is_kept() -> None:
    clock = ManualClock(T0)
    engine, _ = _engine(clock)
    await engine.recorder.decided(_held("node-001", clock.now()), [])
    [record] = await engine.approvals.all()
    clock.advance(TIMEOUT_S + 1)
    await engine.answers.settle()  # expired
    await engine.answers.settle()  # remembered as settled, at the revision read
    # Someone repairs it to pending meanwhile (`state repair`): it is not deleted unread.
    reopened = record.model_copy(update={"expires": clock.now() + 2 * SETTLED_KEPT_S})
    await engine.approvals.store.put(reopened, record.id)
    clock.advance(SETTLED_KEPT_S)
    await engine.answers.settle()
    await engine.answers.settle()
    assert await engine.approvals.get(record.id) == reopened
