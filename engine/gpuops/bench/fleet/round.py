"""One round of `gpuops bench fleet`, measured: replicas ready, publishers started on one
clock, a warm-up, the window (probe failures injected, a lag line every few seconds),
the drain, and the figures."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from nats.errors import Error as NatsError
from nats.js.errors import Error as JsError

from gpuops.bench.fleet.figures import BenchError, FleetSpec, RoundFigures
from gpuops.bench.fleet.procs import (
    PublisherResult,
    Publishers,
    Replica,
    Scrape,
    cpu_s,
    machine_busy_s,
    rss_mb,
    scrape,
)
from gpuops.bus.cluster import LocalCluster
from gpuops.bus.conn import ACTIONS, EVENTS, TELEMETRY, Bus
from gpuops.bus.identity import KeyRing
from gpuops.models import Intent, new_event, subject_for
from gpuops.scale.takeover import all_consumers
from gpuops.sim.fleet import SimFleet


@dataclass(slots=True)
class Snapshot:
    """Counters at one edge of the measured window."""

    at: float
    scrapes: list[Scrape | None]
    replica_cpu: list[float]
    replica_rss: list[float]
    publisher_cpu: float
    nats_cpu: float
    machine: float


@dataclass
class Round:
    """The measuring of one round, on the running cluster, replicas and publishers."""

    spec: FleetSpec
    fleet: SimFleet
    cluster: LocalCluster
    replicas: list[Replica]
    publishers: Publishers
    say: Callable[[str], None]
    cores: int
    keys: KeyRing | None = None  # each injected probe carries its node's MAC
    # probe event id -> (time sent, time the stream acked it)
    sent: dict[str, tuple[float, float]] = field(default_factory=dict)
    max_lag: list[float] = field(default_factory=list)

    async def run(self, bus: Bus) -> RoundFigures:
        """Ready, warm up, measure, drain; the figures."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:
            load0 = os.getloadavg()[0]
            await self._until_ready(http)
            primed = await asyncio.to_thread(self.publishers.primed, self.spec.ready_timeout_s)
            self.say(f"publishers: {len(self.publishers.procs)}, samples built in {primed:.1f}s")
            first, last = await self._window(bus, http)
            results = await asyncio.to_thread(self.publishers.results, 120.0)
            pending = await self._drain(bus)
            final = [await _scrape_hard(http, r) for r in self.replicas]
        to_intent, to_stored = await self._latencies(bus)
        return RoundFigures(
            **_counts(self.spec, len(self.fleet.nodes), results),
            **_usage(first, last, self.spec.gpus),
            replicas=len(self.replicas),
            cores=self.cores,
            gpus=self.spec.gpus,
            stored=await _stored(bus) or 0,
            handled_total=int(sum(s.telemetry for s in final if s is not None)),
            pending_end=pending,
            ready_s=[r.ready_s or 0.0 for r in self.replicas],
            max_lag=self.max_lag,
            load=(load0, os.getloadavg()[0]),
            health_sent=len(self.sent),
            latencies_ms=to_intent,
            stored_ms=to_stored,
        )

    async def _window(self, bus: Bus, http: aiohttp.ClientSession) -> tuple[Snapshot, Snapshot]:
        """Start the publishers, warm up, measure; the snapshots at the window's edges."""
        spec = self.spec
        self.max_lag = [0.0] * len(self.replicas)
        t0 = time.time() + 1.0  # every publisher has its go before it
        self.publishers.go(t0)
        opens, closes = t0 + spec.warmup, t0 + spec.warmup + spec.seconds
        lines = asyncio.create_task(self._lag_lines(bus, http, opens))
        try:
            await _sleep_until(opens)
            first = await self._snapshot(http)
            sending = await self._inject(bus, closes)
            await _sleep_until(closes)
            last = await self._snapshot(http)
            await asyncio.gather(*sending)
            return first, last
        finally:
            lines.cancel()

    async def _until_ready(self, http: aiohttp.ClientSession) -> None:
        deadline = time.monotonic() + self.spec.ready_timeout_s
        while time.monotonic() < deadline:
            for r in self.replicas:
                if (code := r.exited()) is not None:
                    raise BenchError(
                        f"replica {r.name} exited with {code} while starting; its log ends:\n"
                        + r.last_words()
                    )
            if all([await r.ready(http) for r in self.replicas]):
                took = ", ".join(f"{r.name} {r.ready_s or 0:.1f}s" for r in self.replicas)
                self.say(f"replicas ready (/healthz): {took}")
                return
            await asyncio.sleep(0.5)
        raise BenchError(f"replicas not ready in {self.spec.ready_timeout_s:.0f}s")

    async def _snapshot(self, http: aiohttp.ClientSession) -> Snapshot:
        # CPU readings first, at one instant: a busy replica's /metrics may take seconds
        # (each scrape keeps its own time for the rates).
        return Snapshot(
            at=time.monotonic(),
            replica_cpu=[cpu_s(r.pid) for r in self.replicas],
            replica_rss=[rss_mb(r.pid) for r in self.replicas],
            publisher_cpu=self.publishers.cpu_s(),
            nats_cpu=sum(cpu_s(m.pid) for m in self.cluster.members),
            machine=machine_busy_s(),
            scrapes=[await _scrape_hard(http, r) for r in self.replicas],
        )

    async def _lag_lines(self, bus: Bus, http: aiohttp.ClientSession, opens: float) -> None:
        """Every few seconds: stored samples/s, each replica's samples/s and lag."""
        before: list[Scrape | None] = [None] * len(self.replicas)
        stored_before = (time.monotonic(), await _stored(bus))
        while True:
            await asyncio.sleep(self.spec.every)
            now = [await scrape(http, r) for r in self.replicas]
            stored = (time.monotonic(), await _stored(bus))
            parts = [self._stored_part(stored_before, stored)]
            parts += [
                self._replica_part(i, b, n)
                for i, (b, n) in enumerate(zip(before, now, strict=True))
            ]
            lag = await telemetry_pending(bus)
            parts.append(f"stream lag {'?' if lag is None else f'{lag:,}'} events")
            self.say(f"  {time.time() - opens:+5.0f}s " + " | ".join(parts))
            before, stored_before = now, stored

    def _stored_part(self, before: tuple[float, int | None], now: tuple[float, int | None]) -> str:
        if before[1] is None or now[1] is None:
            return "stored ? samples/s"
        return (
            f"stored {(now[1] - before[1]) / (now[0] - before[0]) * self.spec.gpus:,.0f} samples/s"
        )

    def _replica_part(self, i: int, before: Scrape | None, now: Scrape | None) -> str:
        name = self.replicas[i].name
        if now is None:
            return f"{name} (no answer)"
        rate = "?" if before is None else f"{rate_of(before, now, self.spec.gpus):,.0f}"
        if now.lag is not None:
            self.max_lag[i] = max(self.max_lag[i], now.lag)
        lag = "?" if now.lag is None else f"{now.lag:,.0f}"
        held = "" if now.partitions is None else f" ({now.partitions}p)"
        return f"{name}{held} {rate} samples/s lag {lag}"

    async def _inject(self, bus: Bus, closes: float) -> list[asyncio.Task[None]]:
        """Probe failures at a steady rate over the window, each on its own node (spread
        over the fleet, so over the partitions); each is sent at its time, however long
        the ones before take to be stored."""
        nodes = self.fleet.nodes
        count = min(self.spec.health, len(nodes))
        gap = max(0.0, closes - time.time()) / max(1, count)
        start, sending = time.time(), []
        for i in range(count):
            await _sleep_until(start + i * gap)
            node = nodes[i * len(nodes) // count]
            sending.append(asyncio.create_task(self._probe_fail(bus, node, i % self.spec.gpus)))
        return sending

    async def _probe_fail(self, bus: Bus, node: str, gpu: int) -> None:
        t = time.time()
        data = {"gpu": gpu, "ok": False, "outcome": "fail", "error": "bench", "duration_s": 0.3}
        event = new_event("probe", node, t, data, "sim")
        payload, headers = json.dumps(event).encode(), {"Nats-Msg-Id": event["id"]}
        if self.keys is not None:
            headers = self.keys.node(node).headers(payload, headers)
        for _ in range(20):  # a stream leader may be slow to answer under load; the id dedups
            try:
                await bus.js.publish(subject_for("probe", node), payload, headers=headers)
            except (NatsError, JsError, TimeoutError):
                continue
            self.sent[event["id"]] = (t, time.time())
            return

    async def _drain(self, bus: Bus) -> int:
        """Wait until the replicas have read everything (or drain_s); telemetry left."""
        deadline = time.monotonic() + self.spec.drain_s
        left = 0
        while time.monotonic() < deadline:
            telemetry, events = await telemetry_pending(bus), await _pending(bus, EVENTS)
            left = telemetry if telemetry is not None else left
            if telemetry == 0 and events == 0:
                return 0
            await asyncio.sleep(1.0)
        return left

    async def _latencies(self, bus: Bus) -> tuple[list[float], list[float]]:
        """In ms: each injected event's intent's decided_at minus the time the event was
        sent; and, for every injected event, the time the stream took to ack it."""
        to_intent = []
        for intent in await read_intents(bus):
            sent = self.sent.get(intent.event_id)
            if sent is not None:
                to_intent.append((intent.decided_at - sent[0]) * 1000.0)
        return to_intent, [(acked - t) * 1000.0 for t, acked in self.sent.values()]


def _counts(spec: FleetSpec, nodes: int, results: list[PublisherResult]) -> dict[str, Any]:
    window = slice(spec.warmup, spec.warmup + spec.seconds)
    return {
        "offered": nodes * spec.seconds,
        "published": sum(sum(r.published[window]) for r in results),
        "missed": sum(sum(r.missed[window]) for r in results),
        "published_total": sum(sum(r.published) for r in results),
        "bytes_total": sum(r.bytes for r in results),
    }


def _usage(first: Snapshot, last: Snapshot, gpus: int) -> dict[str, Any]:
    span = last.at - first.at
    scrapes = zip(first.scrapes, last.scrapes, strict=True)
    return {
        "window_s": span,
        "handled_per_s": [rate_of(a, b, gpus) if a and b else 0.0 for a, b in scrapes],
        "cpu_cores": [
            (b - a) / span for a, b in zip(first.replica_cpu, last.replica_cpu, strict=True)
        ],
        "rss_mb": last.replica_rss,
        "publisher_cores": (last.publisher_cpu - first.publisher_cpu) / span,
        "nats_cores": (last.nats_cpu - first.nats_cpu) / span,
        "machine_cores": (last.machine - first.machine) / span,
    }


def rate_of(a: Scrape, b: Scrape, gpus: int) -> float:
    """Samples per second a replica handled between two scrapes."""
    return (b.telemetry - a.telemetry) / max(b.at - a.at, 1e-9) * gpus


async def _scrape_hard(http: aiohttp.ClientSession, replica: Replica) -> Scrape | None:
    """A scrape at a window's edge: a busy replica gets a few tries."""
    for _ in range(3):
        got = await scrape(http, replica)
        if got is not None:
            return got
    return None


async def _sleep_until(epoch: float) -> None:
    await asyncio.sleep(max(0.0, epoch - time.time()))


async def _stored(bus: Bus) -> int | None:
    """Telemetry events the stream has taken (its last sequence; None: no answer)."""
    try:
        return int((await bus.js.stream_info(TELEMETRY)).state.last_seq)
    except (NatsError, JsError, TimeoutError):
        return None


async def _pending(bus: Bus, stream: str) -> int | None:
    """Messages of a stream its consumers have not yet acked (None: no answer)."""
    try:
        infos = await all_consumers(bus.js, stream)
    except (NatsError, JsError, TimeoutError):
        return None
    return sum(int(c.num_pending or 0) + int(c.num_ack_pending or 0) for c in infos)


async def telemetry_pending(bus: Bus) -> int | None:
    """The telemetry lag over every consumer (every partition) of the stream, in events."""
    return await _pending(bus, TELEMETRY)


async def read_intents(bus: Bus) -> list[Intent]:
    """Every intent in the actions queue (no executor takes them in the bench)."""
    info = await bus.js.stream_info(ACTIONS)
    out = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        with contextlib.suppress(JsError):  # a gap: nothing stored at that sequence
            msg = await bus.js.get_msg(ACTIONS, seq)
            out.append(Intent.model_validate_json(msg.data or b""))
    return out
