"""A silence covers what it names, for as long as a person may silence, and no more.

Real nats-server and the command table over the engine's buckets: a `label:` target no
host carries used to cover every host (a missing variable read as "None"), and a
duration of 309 nines was infinite: stored as JSON null, the silence was unreadable, so
it stopped automation everywhere, its command answered 500 and nothing was audited.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gpuops.bus.conn import Bus
from gpuops.bus.publish import JetStreamPublisher
from gpuops.clock import SystemClock
from gpuops.decide.silence import Silence
from gpuops.decide.stores import Stores
from gpuops.inventory.hosts import Inventory
from gpuops.match.durations import parse_duration
from gpuops.ops.cmdwire import CommandUsageError
from gpuops.ops.commands import MAX_REASON, Caller, Commands
from gpuops.record.audit import read_audit
from gpuops.settings import ChatopsSettings

pytestmark = pytest.mark.integration
NODES = frozenset({"node-001", "node-002"})
INVENTORY = Inventory(
    Path("inv"), NODES, {"gpu": NODES}, {"node-001": {"rack": "r1"}, "node-002": {"rack": "r2"}}
)
ALICE = Caller.of("cli", "alice")


def _commands(bus: Bus) -> tuple[Commands, Stores]:
    stores = Stores.over(bus.buckets, JetStreamPublisher(bus.js))
    return Commands(bus, SystemClock(), INVENTORY, ChatopsSettings(), stores), stores


def test_a_label_covers_only_the_hosts_that_carry_it() -> None:
    silence = Silence(id="s", target="label:no_such_var=None", starts=0, ends=1, reason="r")
    assert not any(silence.covers("xid-79", n, INVENTORY) for n in NODES)
    rack = Silence(id="s", target="label:rack=r1", starts=0, ends=1, reason="r")
    assert [n for n in sorted(NODES) if rack.covers("xid-79", n, INVENTORY)] == ["node-001"]


def test_a_duration_too_long_for_a_number_is_refused() -> None:
    with pytest.raises(ValueError, match="too long"):
        parse_duration("9" * 309 + "d")


async def test_a_silence_longer_than_allowed_or_of_a_label_no_host_has_is_refused(
    bus: Bus,
) -> None:
    commands, stores = _commands(bus)
    with pytest.raises(CommandUsageError, match=r"at most 30d \(chatops.max_silence_s\)"):
        await commands.execute("silence node:node-001 31d maintenance", ALICE)
    with pytest.raises(CommandUsageError, match="bad duration"):
        await commands.execute(f"silence node:node-001 {'9' * 309}d forever", ALICE)
    with pytest.raises(CommandUsageError, match="at most 500 characters"):
        await commands.execute(f"silence node:node-001 1h {'x' * 501}", ALICE)
    with pytest.raises(Exception, match="no host of the inventory has rack=r9"):
        await commands.execute("silence label:rack=r9 1h typo", ALICE)
    assert await stores.silences.all() == [], "nothing stored"
    done = await commands.execute("silence label:rack=r1 30d rack move", ALICE)
    assert done.startswith("silence ") and "label:rack=r1 for 30d" in done
    forced = await commands.execute("silence label:rack=r9 1h new rack --force", ALICE)
    assert "label:rack=r9" in forced, "a label about to exist, forced"
    assert len(await stores.silences.all()) == 2


async def test_a_reason_as_long_as_allowed_is_audited_whole(bus: Bus) -> None:
    commands, _ = _commands(bus)
    reason = " ".join(f"w{i:03d}" for i in range(MAX_REASON // 5 + 1))[:MAX_REASON]
    await commands.execute(f"silence node:node-001 1h {reason}", ALICE)
    notes = [r.summary async for r in read_audit(bus.js) if r.type == "note"]
    assert any(reason in n and "characters)" not in n for n in notes), notes
