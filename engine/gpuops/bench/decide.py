"""`gpuops bench decide`: what one decision costs in KV/JetStream round trips and time.

The engine is the one `gpuops run` builds (gpuops/spine/build.py, every safety stage, the
recorder) on a real nats-server started here with the engine's streams and buckets.
Every KV call and publish is timed through a wrapper; the critical path of a decision
is the longest chain of calls each issued after the one before it answered, so calls
issued together count once. One match per node of a rule that passes every stage
(accepted), then a second match per node on the same key (dropped by the cooldown).
Default settings, but for the breaker's share of the fleet (the bench's fleet is small).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TypeVar

from gpuops.bus.buckets import Buckets
from gpuops.bus.conn import connect
from gpuops.bus.publish import JetStreamPublisher, Publisher
from gpuops.bus.server import EmbeddedNats
from gpuops.bus.store import KV, Entry
from gpuops.catalog import load_catalog
from gpuops.clock import SystemClock
from gpuops.decide.breaker import BreakerState
from gpuops.inventory.hosts import Inventory
from gpuops.match.loader import load_rules
from gpuops.models import Match, Reason, Request
from gpuops.settings import NatsSettings, SafetySettings, Settings, checkout_root
from gpuops.spine.build import build_engine
from gpuops.spine.pipeline import Pipeline

R = TypeVar("R")
WARM_UP = 5  # decisions on nodes of their own before measuring: connections, silences
# A live breaker counts at most its limit of nodes (default 20) before it opens; closing it
# every so often keeps its record that small, and the breaker closed, as in a calm fleet.
BREAKER_EVERY = 15


@dataclass
class Calls:
    """Every round trip since the last reset: its operation and when it was issued and answered."""

    spans: list[tuple[str, float, float]] = field(default_factory=list)

    async def timed(self, op: str, call: Awaitable[R]) -> R:
        """Await one round trip, noting it."""
        start = time.perf_counter()
        try:
            return await call
        finally:
            self.spans.append((op, start, time.perf_counter()))

    def critical_path(self) -> int:
        """The longest chain of calls each issued after the previous one answered."""
        spans = sorted(self.spans, key=lambda s: s[1])
        depth: list[int] = []
        for i, (_, start, _) in enumerate(spans):
            before = [depth[j] for j in range(i) if spans[j][2] <= start]
            depth.append(1 + max(before, default=0))
        return max(depth, default=0)

    def take(self) -> tuple[int, int, Counter[str]]:
        """(critical path, total calls, calls per operation), and start counting afresh."""
        found = (self.critical_path(), len(self.spans), Counter(op for op, _, _ in self.spans))
        self.spans = []
        return found


class TimedKV:
    """A KV whose every call is noted in `calls`."""

    def __init__(self, kv: KV, calls: Calls) -> None:
        self.kv = kv
        self.calls = calls
        self.name = kv.name

    async def get(self, key: str) -> Entry | None:
        return await self.calls.timed("kv.get", self.kv.get(key))

    async def put(self, key: str, value: bytes) -> int:
        return await self.calls.timed("kv.put", self.kv.put(key, value))

    async def cas(self, key: str, value: bytes, revision: int) -> int | None:
        return await self.calls.timed("kv.cas", self.kv.cas(key, value, revision))

    async def delete(self, key: str, revision: int | None = None) -> bool:
        return await self.calls.timed("kv.delete", self.kv.delete(key, revision))

    async def keys(self, prefix: str = "") -> list[str]:
        return await self.calls.timed("kv.keys", self.kv.keys(prefix))


class TimedPublisher:
    """A publisher whose every publish is noted in `calls`."""

    def __init__(self, publisher: Publisher, calls: Calls) -> None:
        self.publisher = publisher
        self.calls = calls

    async def publish(self, subject: str, payload: bytes, msg_id: str | None = None) -> bool:
        stored = self.publisher.publish(subject, payload, msg_id)
        return await self.calls.timed("js.publish", stored)


@dataclass
class Figures:
    """Latencies (seconds) and round trips of the measured decisions."""

    accepted: list[float] = field(default_factory=list)
    dropped: list[float] = field(default_factory=list)
    paths: list[int] = field(default_factory=list)
    totals: list[int] = field(default_factory=list)
    ops: Counter[str] = field(default_factory=Counter)
    dropped_paths: list[int] = field(default_factory=list)
    wrong: Counter[str] = field(default_factory=Counter)  # decisions not as expected


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000.0 if ordered else 0.0


def _match(rule: str, node: str, n: int, now: float) -> Match:
    return Match(
        rule=rule,
        kind="xid",
        node=node,
        gpu=3,
        gpus=(3,),
        key=f"{node}/3",
        event_id=f"bench-{node}-{n}-{now}",
        event_ts=now,
        at=now,
        severity="critical",
        facts={"node": node, "gpu": 3, "xid": 48},
    )


async def _decide(pipeline: Pipeline, rule: str, node: str, n: int) -> tuple[float, bool]:
    """Seconds the n-th match on `node` took, and whether it was decided as expected
    (the first accepted, the next dropped by the cooldown)."""
    start = time.perf_counter()
    decided = await pipeline.handle(Request(match=_match(rule, node, n, time.time())))
    took = time.perf_counter() - start
    if not decided:
        raise ValueError(f"no rule {rule!r} in the shipped rules")
    return took, decided[0].reason is (Reason.ACCEPTED if n == 0 else Reason.COOLDOWN)


async def _measure(store: Path, nodes: int, rule: str) -> Figures:
    root, calls, figures = checkout_root(), Calls(), Figures()
    server = EmbeddedNats(store).start()
    try:
        bus = await connect(server.url, NatsSettings(), "gpuops-bench")
        names = [f"bench-{i:05d}" for i in range(WARM_UP + nodes)]
        built = bus.buckets
        buckets = Buckets(**{f.name: TimedKV(getattr(built, f.name), calls) for f in fields(built)})
        engine = build_engine(
            Settings(safety=SafetySettings(breaker_share=1.0)),
            rules=load_rules([root / "rules"], root / "playbooks"),
            inventory=Inventory(Path("bench"), frozenset(names), {}, {n: {} for n in names}),
            catalog=load_catalog(root / "playbooks"),
            buckets=buckets,
            publisher=TimedPublisher(JetStreamPublisher(bus.js), calls),
            clock=SystemClock(),
            signing_key=os.urandom(32),
        )
        for node in names[:WARM_UP]:
            await _decide(engine.pipeline, rule, node, 0)
        calls.take()
        for i, node in enumerate(names[WARM_UP:]):
            if i % BREAKER_EVERY == 0:  # not measured
                await engine.breaker.set_state(BreakerState.CLOSED, "bench", time.time())
                calls.take()
            took, ok = await _decide(engine.pipeline, rule, node, 0)
            path, total, ops = calls.take()
            figures.accepted.append(took)
            figures.paths.append(path)
            figures.totals.append(total)
            figures.ops.update(ops)
            figures.wrong["accepted"] += not ok
        for node in names[WARM_UP:]:
            took, ok = await _decide(engine.pipeline, rule, node, 1)
            figures.dropped.append(took)
            figures.dropped_paths.append(calls.take()[0])
            figures.wrong["cooldown"] += not ok
        await bus.close()
    finally:
        server.stop()
    return figures


def bench_decide(nodes: int = 300, rule: str = "xid-48-dbe") -> Iterator[str]:
    """Decide `rule` once on each of `nodes` nodes and again in its cooldown; report lines."""
    with tempfile.TemporaryDirectory(prefix="gpuops-bench-decide-") as tmp:
        f = asyncio.run(_measure(Path(tmp) / "nats", nodes, rule))
    cores = len(os.sched_getaffinity(0))
    yield f"{rule} on {nodes} nodes, real nats-server, {cores} cores, load {os.getloadavg()[0]:.1f}"
    per = ", ".join(f"{op} {n / nodes:.1f}" for op, n in sorted(f.ops.items()))
    yield (
        f"accepted: round trips on the critical path median {statistics.median(f.paths):.0f} "
        f"(min {min(f.paths)}, max {max(f.paths)}); issued median "
        f"{statistics.median(f.totals):.0f} ({per} per decision)"
    )
    yield (
        f"accepted: p50 {_pct(f.accepted, 0.5):.2f} ms, p99 {_pct(f.accepted, 0.99):.2f} ms; "
        f"dropped (cooldown): p50 {_pct(f.dropped, 0.5):.2f} ms, "
        f"p99 {_pct(f.dropped, 0.99):.2f} ms, critical path median "
        f"{statistics.median(f.dropped_paths):.0f}"
    )
    yield (
        f"critical_path={statistics.median(f.paths):.0f} "
        f"accepted_p50_ms={_pct(f.accepted, 0.5):.2f} accepted_p99_ms={_pct(f.accepted, 0.99):.2f} "
        f"dropped_p50_ms={_pct(f.dropped, 0.5):.2f} dropped_p99_ms={_pct(f.dropped, 0.99):.2f} "
        f"unexpected={sum(f.wrong.values())}"
    )
