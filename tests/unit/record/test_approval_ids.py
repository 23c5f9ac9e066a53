"""Approval ids: 64 bits of the held match, and a match whose id another match already
holds gets one of its own (the second held decision is still put to a person)."""

from __future__ import annotations

from gpuops.bus.store import MemoryKV
from gpuops.models import ActionSpec, Decision, Match, Reason
from gpuops.record.approvals import ApprovalStatus, ApprovalStore, approval_id

T0 = 1_800_000_000.0


def _held(event_id: str, node: str = "node-002") -> Decision:
    match = Match(
        rule="drift-needs-approval",
        kind="drift",
        node=node,
        gpu=None,
        key=node,
        event_id=event_id,
        event_ts=T0,
        at=T0,
        facts={"node": node},
    )
    return Decision(
        match=match,
        accepted=False,
        reason=Reason.APPROVAL_PENDING,
        actions=(ActionSpec(playbook="baseline.yml"),),
    )


def test_an_id_has_64_bits() -> None:
    ident = approval_id(_held("ev-1"))
    assert len(ident) >= 16 and int(ident, 16) >= 0


async def test_a_match_whose_id_is_held_by_another_opens_its_own_record() -> None:
    store = ApprovalStore(MemoryKV("control"))
    first, second = _held("ev-a"), _held("ev-b")
    # `second` met `first`'s id: the record under it holds another match.
    planted, _ = await store.open(first, T0, 1800)
    colliding = planted.model_copy(update={"id": approval_id(second)})
    await store.store.put(colliding, approval_id(second))

    record, opened = await store.open(second, T0, 1800)
    assert opened, "the second held decision is put to a person"
    assert record.id != approval_id(second) and record.match.event_id == "ev-b"
    assert await store.get(record.id) == record
    assert (await store.get(approval_id(second))) == colliding, "the other one is kept"

    again, opened_again = await store.open(second, T0 + 1, 1800)
    assert (again, opened_again) == (record, False), "a replay finds its own record"
    decided = await store.decide(record.id, True, "alice", T0 + 2)
    assert decided.status is ApprovalStatus.APPROVED and decided.match.event_id == "ev-b"
