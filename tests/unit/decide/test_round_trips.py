"""Issue 16 part 4: a decision's KV reads go together, its commits go together, and the
order that makes it crash-consistent holds (lock, then intents, then commits).

The buckets are in memory, but every call yields to the event loop a few times first, as
a call to NATS waits longer than a task takes to start, so calls issued together overlap
and calls issued one after another do not.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field, fields
from typing import Any

import pytest
from gpuops.bus.buckets import Buckets
from gpuops.bus.publish import MemoryPublisher
from gpuops.bus.store import KV, Entry, MemoryKV, Store, together
from gpuops.clock import ManualClock
from gpuops.decide.history import Attempt, AttemptLog
from gpuops.errors import BusError
from gpuops.match.loader import load_rules
from gpuops.models import Reason

from tests.support import decide
from tests.unit.decide.helpers import ROOT, T0, engine_on, match

RULESET = load_rules([ROOT / "rules"], ROOT / "playbooks")
RULES = {r.name: r for r in RULESET.rules}
TICKS = itertools.count()
HOPS = 4  # event-loop turns a round trip takes


async def _round_trip() -> None:
    for _ in range(HOPS):
        await asyncio.sleep(0)


@dataclass(frozen=True, slots=True)
class Call:
    """One call: what and on which bucket and key, issued and answered (in tick order)."""

    op: str
    where: str
    start: int
    end: int


@dataclass
class Calls:
    """Every call since the last `take`."""

    log: list[Call] = field(default_factory=list)
    failing: set[tuple[str, str]] = field(default_factory=set)  # (op, key) that raise

    def waves(self) -> list[list[Call]]:
        """Calls by depth: wave n+1 holds the calls issued after one of wave n answered."""
        depth: dict[Call, int] = {}
        for c in sorted(self.log, key=lambda c: c.start):
            depth[c] = 1 + max((depth[b] for b in depth if b.end < c.start), default=0)
        return [[c for c in self.log if depth[c] == n] for n in range(1, max(depth.values()) + 1)]

    def take(self) -> list[Call]:
        """The calls noted, and start afresh."""
        log, self.log = self.log, []
        return log


class NetKV:
    """A memory bucket whose calls take a round trip and are noted."""

    def __init__(self, name: str, calls: Calls) -> None:
        self.kv: KV = MemoryKV()
        self.name = name
        self.calls = calls

    async def _call(self, op: str, key: str) -> None:
        await _round_trip()
        if (op, key) in self.calls.failing:
            self.calls.failing.discard((op, key))
            raise BusError(f"{op} {key}: no answer (the bus went away)")

    async def get(self, key: str) -> Entry | None:
        start = next(TICKS)
        await self._call("get", key)
        found = await self.kv.get(key)
        self.calls.log.append(Call("get", f"{self.name}:{key}", start, next(TICKS)))
        return found

    async def put(self, key: str, value: bytes) -> int:
        start = next(TICKS)
        await self._call("put", key)
        rev = await self.kv.put(key, value)
        self.calls.log.append(Call("put", f"{self.name}:{key}", start, next(TICKS)))
        return rev

    async def cas(self, key: str, value: bytes, revision: int) -> int | None:
        start = next(TICKS)
        await self._call("cas", key)
        rev = await self.kv.cas(key, value, revision)
        self.calls.log.append(Call("cas", f"{self.name}:{key}", start, next(TICKS)))
        return rev

    async def delete(self, key: str, revision: int | None = None) -> bool:
        await self._call("delete", key)
        return await self.kv.delete(key, revision)

    async def keys(self, prefix: str = "") -> list[str]:
        await self._call("keys", prefix)
        return await self.kv.keys(prefix)


class NetPublisher(MemoryPublisher):
    """A memory publisher whose publishes take a round trip and are noted."""

    def __init__(self, calls: Calls) -> None:
        super().__init__()
        self.calls = calls

    async def publish(self, subject: str, payload: bytes, msg_id: str | None = None) -> bool:
        start = next(TICKS)
        await _round_trip()
        stored = await super().publish(subject, payload, msg_id)
        self.calls.log.append(Call("publish", subject, start, next(TICKS)))
        return stored


def _buckets(calls: Calls) -> Buckets:
    return Buckets(**{f.name: NetKV(f.name, calls) for f in fields(Buckets)})


def _wheres(calls: list[Call]) -> set[str]:
    """Where the calls went, a cooldown's key (a digest of rule and group key) as `*`."""
    return {"cooldowns:cooldown.*" if "cooldown." in c.where else c.where for c in calls}


async def test_an_accepted_decision_reads_together_and_commits_together() -> None:
    calls, clock = Calls(), ManualClock(T0)
    engine = engine_on(clock, _buckets(calls), publisher=NetPublisher(calls))
    rule = RULES["xid-48-dbe"]  # a GPU reset: every stage reads and remembers
    d = await engine.pipeline.decider.decide(match(rule.name), rule)
    assert d.accepted
    reads, lock, breaker, commits = calls.waves()
    assert {c.op for c in reads} == {"get"} and _wheres(reads) == {
        "cooldowns:cooldown.*",
        "history:heavy.node-001",
        "locks:node.node-001",
        "history:attempts.node-001",
        "control:breaker.fleet",
        "nodes:state.node-001",  # read by whatever acts: an unreadable one stops it
        "nodes:episode.xid-48-dbe.node-001",  # and the episode its intents name
    }
    assert [(c.op, c.where) for c in lock] == [("cas", "locks:node.node-001")]
    # The breaker counts the node in at check, once the stages above it let it through.
    assert [(c.op, c.where) for c in breaker] == [("cas", "control:breaker.fleet")]
    # Each commit starts from the revision its check read: no read before its write (the
    # breaker's has nothing to add, and checks that on a fresh read).
    assert [(c.op, c.where) for c in commits if c.op == "get"] == [("get", "control:breaker.fleet")]
    assert len(commits) == 5


async def test_a_decision_stores_intents_after_the_lock_and_before_any_commit() -> None:
    calls, clock = Calls(), ManualClock(T0)
    engine = engine_on(clock, _buckets(calls), rules=RULESET, publisher=NetPublisher(calls))
    rule = RULES["xid-48-dbe"]
    calls.take()
    d = await decide(engine.pipeline, match(rule.name))
    assert d is not None and d.accepted
    log = sorted(calls.take(), key=lambda c: c.start)
    intent = next(c for c in log if c.where.startswith("gpuops.actions."))
    changes = [c for c in log if c.op in ("put", "cas", "publish") and c is not intent]
    taken = [c for c in changes if c.start < intent.start]  # at check: lock, breaker count
    assert [(c.op, c.where) for c in taken] == [
        ("cas", "locks:node.node-001"),
        ("cas", "control:breaker.fleet"),
    ]
    assert all(c.end < intent.start for c in taken)
    writes = [c for c in changes if c not in taken]
    assert writes and all(intent.end < c.start for c in writes), "a commit before the intent"
    audit = [c for c in writes if c.where.startswith("gpuops.audit.")]
    assert len(audit) == 1, "the decision is in the audit trail when the entry returns"
    # Before: 23 calls one after another; now reads, lock, breaker, intents, then the
    # commits alongside the record stage (node state and episode: read, then write).
    assert len(Calls(log).waves()) <= 7


async def test_a_running_cooldown_drops_without_a_kv_read() -> None:
    calls, clock = Calls(), ManualClock(T0)
    engine = engine_on(clock, _buckets(calls))
    rule = RULES["xid-48-dbe"]
    assert (await engine.pipeline.decider.decide(match(rule.name), rule)).accepted
    clock.advance(10)
    calls.take()
    again = await engine.pipeline.decider.decide(match(rule.name, t=clock.now()), rule)
    assert again.reason is Reason.COOLDOWN
    assert calls.take() == [], "the stages below the cooldown read nothing ahead of it"


async def test_stages_below_the_ladder_read_after_it_picked_the_rung() -> None:
    calls, clock = Calls(), ManualClock(T0)
    engine = engine_on(clock, _buckets(calls))
    rule = RULES["xid-79-gpu-lost"]  # its actions come from the ladder's rung
    d = await engine.pipeline.decider.decide(match(rule.name, gpu=None), rule)
    assert d.accepted and d.actions[0].playbook == "reboot.yml"
    first, second, lock, breaker, _ = calls.waves()
    assert _wheres(first) == {
        "cooldowns:cooldown.*",
        "history:ladder.node-001.gpu-lost",
        "locks:node.node-001",  # past the last rung, a run still in flight holds the ladder
    }
    assert _wheres(second) == {
        "history:heavy.node-001",
        "nodes:state.node-001",
        "nodes:episode.xid-79-gpu-lost.node-001",  # the episode its intent names
        "history:attempts.node-001",
        "control:breaker.fleet",
    }
    assert [c.op for c in lock] == ["cas"] and [c.op for c in breaker] == ["cas"]


async def test_a_commit_that_fails_leaves_the_event_to_decide_the_same_again() -> None:
    calls, clock = Calls(), ManualClock(T0)
    engine = engine_on(clock, _buckets(calls))
    decider, rule = engine.pipeline.decider, RULES["xid-48-dbe"]
    calls.failing.add(("cas", "attempts.node-001"))
    with pytest.raises(BusError):  # its own type, so the intake naks, not dead-letters
        await decider.decide(match(rule.name), rule)
    cooldown = [c for c in calls.take() if c.where.startswith("cooldowns:") and c.op == "put"]
    assert cooldown, "the other commits went ahead, together"
    again = await decider.decide(match(rule.name), rule)  # the redelivered event
    assert again.accepted and again.holds_lock, again
    log, _ = await Store(engine.buckets.history, AttemptLog, "attempts").get("node-001")
    assert log is not None and len(log.attempts) == 1, "counted once, on the second try"


async def test_update_from_a_stale_read_writes_on_the_current_record() -> None:
    store: Store[AttemptLog] = Store(MemoryKV(), AttemptLog, "attempts")
    old = AttemptLog(attempts=(Attempt(at=1.0, event_id="a"),))
    rev = await store.put(old, "n")
    await store.put(AttemptLog(attempts=(Attempt(at=2.0, event_id="b"),)), "n")  # another writer

    def add(log: AttemptLog | None) -> AttemptLog:
        return AttemptLog(attempts=(*(log or AttemptLog()).attempts, Attempt(at=3.0, event_id="c")))

    await store.update(add, "n", known=(old, rev))
    now, _ = await store.get("n")
    assert now is not None and [a.event_id for a in now.attempts] == ["b", "c"]


async def test_update_checks_nothing_to_change_on_a_fresh_read() -> None:
    store: Store[AttemptLog] = Store(MemoryKV(), AttemptLog, "attempts")
    seen = AttemptLog(attempts=(Attempt(at=1.0, event_id="a"),))
    rev = await store.put(seen, "n")
    await store.put(AttemptLog(), "n")  # a person cleared the history meanwhile

    def once(log: AttemptLog | None) -> AttemptLog | None:
        current = log or AttemptLog()
        if any(a.event_id == "a" for a in current.attempts):
            return None
        return AttemptLog(attempts=(*current.attempts, Attempt(at=1.0, event_id="a")))

    await store.update(once, "n", known=(seen, rev))
    now, _ = await store.get("n")
    assert now is not None and [a.event_id for a in now.attempts] == ["a"]


async def test_together_waits_for_all_then_raises_the_first_failure() -> None:
    done: list[str] = []

    async def fails() -> None:
        await asyncio.sleep(0)
        raise BusError("no answer")

    async def slow() -> None:
        await asyncio.sleep(0.01)
        done.append("slow")

    with pytest.raises(BusError, match="no answer"):
        await together(fails(), slow())
    assert done == ["slow"]
    assert await together(asyncio.sleep(0, "a"), asyncio.sleep(0, "b")) == ["a", "b"]


async def test_together_runs_waiting_calls_at_once_and_others_without_a_task() -> None:
    """Started in order, each call that never waits ends before the next starts and makes
    no task; calls that wait still wait at the same time (each sets what the other needs)."""
    order: list[str] = []
    ping, pong = asyncio.Event(), asyncio.Event()

    async def plain(name: str) -> str:
        order.append(name)
        return name

    async def first() -> str:
        order.append("first waits")
        ping.set()
        await pong.wait()
        return "first"

    async def second() -> str:
        order.append("second waits")
        await ping.wait()
        pong.set()
        return "second"

    loop, made = asyncio.get_running_loop(), []

    def counting(loop: asyncio.AbstractEventLoop, coro: Any) -> asyncio.Task[Any]:
        made.append(coro)
        return asyncio.Task(coro, loop=loop)

    loop.set_task_factory(counting)
    try:
        assert await together(plain("a"), plain("b"), plain("c")) == ["a", "b", "c"]
        assert made == [], "no call waited: no task"
        got = await asyncio.wait_for(together(plain("x"), first(), second(), plain("y")), 2.0)
    finally:
        loop.set_task_factory(None)
    assert got == ["x", "first", "second", "y"]
    assert order == ["a", "b", "c", "x", "first waits", "second waits", "y"]


async def test_together_fails_with_the_first_failure_in_order_of_the_calls() -> None:
    async def at_once() -> None:
        raise BusError("first, without waiting")

    async def later() -> None:
        await asyncio.sleep(0)
        raise ValueError("second")

    with pytest.raises(BusError, match="first, without waiting"):
        await together(at_once(), later())
    with pytest.raises(ValueError, match="second"):
        await together(later(), at_once())


async def test_a_cancelled_together_cancels_the_calls_still_waiting() -> None:
    cleaned: list[str] = []

    async def waits() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.append("waits")

    async def ends() -> str:
        return "ends"

    outer = asyncio.ensure_future(together(ends(), waits()))
    await asyncio.sleep(0.01)
    outer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await outer
    assert cleaned == ["waits"]


async def test_a_caller_cancelled_before_its_calls_tasks_ran_still_cancels_each_call() -> None:
    """A cancellation already on its way when `together` starts its calls: each call,
    started, sees it and cleans up (its `finally` may wait), none is left holding."""
    held: set[int] = set()
    seen: list[str] = []

    async def holds(n: int) -> None:
        held.add(n)  # what a call does before its first wait (a request sent, a lock)
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            seen.append(f"cancelled {n}")
            raise
        finally:
            await asyncio.sleep(0)
            held.discard(n)

    async def caller() -> None:
        me = asyncio.current_task()
        assert me is not None
        asyncio.get_running_loop().call_soon(me.cancel)
        await together(holds(1), holds(2))

    with pytest.raises(asyncio.CancelledError):
        await asyncio.ensure_future(caller())
    await asyncio.sleep(0.01)
    assert held == set() and sorted(seen) == ["cancelled 1", "cancelled 2"]
