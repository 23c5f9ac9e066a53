"""`state repair` mends unreadable records only, and grants no other command's power.

Real nats-server, the engine's buckets and command table (as the engine builds it,
`model_of` included). Bob may run `state` (a CLI operator) but not `approve` nor
`breaker`; Alice may run both.
"""

from __future__ import annotations

import time

import pytest
from gpuops.bus.conn import Bus
from gpuops.bus.publish import JetStreamPublisher
from gpuops.bus.store import NatsKV
from gpuops.clock import SystemClock
from gpuops.decide.breaker import BreakerState
from gpuops.decide.stores import Stores
from gpuops.models import Match
from gpuops.ops.cmdwire import CommandError
from gpuops.ops.commands import Caller, Commands
from gpuops.record.approvals import ApprovalRecord, ApprovalStatus
from gpuops.settings import ChatopsSettings
from gpuops.spine.statemodels import model_of

pytestmark = pytest.mark.integration
GARBAGE = b"\x00\xffnot a record{"
BOB, ALICE = Caller.of("cli", "bob"), Caller.of("cli", "alice")
GRANTS = {"permissions": {"approve": {"users": ["cli:alice"]}, "breaker": {"users": ["cli:alice"]}}}


def _commands(bus: Bus) -> tuple[Commands, Stores]:
    stores = Stores.over(bus.buckets, JetStreamPublisher(bus.js))
    settings = ChatopsSettings.model_validate(GRANTS)
    return Commands(bus, SystemClock(), None, settings, stores, model_of=model_of), stores


async def _refused(commands: Commands, caller: Caller, line: str) -> str:
    with pytest.raises(CommandError) as caught:
        await commands.execute(line, caller)
    return str(caught.value)


async def test_a_readable_approval_or_breaker_is_not_rewritten_through_state_repair(
    bus: Bus,
) -> None:
    commands, stores = _commands(bus)
    now = time.time()
    match = Match(rule="xid-79", kind="xid", node="node-001", key="node-001", event_id="e1",
                  event_ts=now, at=now)  # fmt: skip
    expired = ApprovalRecord(id="3fa2c1d0", rule="xid-79", node="node-001", key="node-001",
                             summary="xid-79 would run gpu_reset.yml", match=match,
                             created=now - 7200, expires=now - 3600)  # fmt: skip
    await stores.approvals.store.put(expired, expired.id)
    await stores.breaker.set_state(BreakerState.OPEN, "tripped", now, "engine")
    approved = expired.model_copy(
        update={"status": ApprovalStatus.APPROVED, "by": "slack:T0/U0BOSS", "expires": now + 60}
    )
    set_approved = f"state repair control approval.3fa2c1d0 --set '{approved.model_dump_json()}'"
    reset = "state repair control breaker.fleet --delete"
    assert "needs 'approve': cli:bob may not run 'approve'" in await _refused(
        commands, BOB, set_approved
    )
    assert "needs 'breaker'" in await _refused(commands, BOB, reset)
    # Alice may approve and reset, with `approve` and `breaker`: never by a rewrite.
    why = await _refused(commands, ALICE, set_approved)
    assert "decodes as ApprovalRecord: state repair mends only unreadable records" in why
    assert "decodes as BreakerRecord" in await _refused(commands, ALICE, reset)
    assert await stores.approvals.get("3fa2c1d0") == expired
    assert (await stores.breaker.shown(stores.unreadable))[0].state is BreakerState.OPEN


async def test_an_unreadable_record_of_a_persons_authority_needs_that_persons_grant(
    bus: Bus,
) -> None:
    commands, _ = _commands(bus)
    control = NatsKV(bus.kv["control"])
    await control.put("breaker.fleet", GARBAGE)
    await NatsKV(bus.kv["cooldowns"]).put("cooldown.0badc0de", GARBAGE)
    why = await _refused(commands, BOB, "state repair control breaker.fleet --delete")
    assert why.startswith("state: repairing control/breaker.fleet needs 'breaker'")
    assert "cli:bob may not run 'breaker'" in why
    assert (await control.get("breaker.fleet")) is not None, "still there"
    done = await commands.execute("state repair control breaker.fleet --delete", ALICE)
    assert "deleted" in done
    # A cooldown holds no person's authority: the `state` grant is enough.
    done = await commands.execute("state repair cooldowns cooldown.0badc0de --delete", BOB)
    assert "deleted" in done
