"""Drives a simulated fleet onto the bus: what every node's agent would publish, plus faults.

One process plays every agent: telemetry each simulated second (core publish, as the
agent does), heartbeats, probe results and XID/ECC events (JetStream publish with a
message id), and the scenario's faults at their times.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nats.errors import Error as NatsError

from gpuops import subjects
from gpuops.agent.probe import requested_nonce
from gpuops.bus.conn import Bus
from gpuops.bus.identity import KeyRing
from gpuops.bus.wire import TelemetryWriter
from gpuops.clock import ScaledClock
from gpuops.models import subject_for
from gpuops.sim.fleet import SimFleet, envelope
from gpuops.sim.scenario import Fault, Scenario

log = logging.getLogger(__name__)


@dataclass
class DriverStats:
    """What the driver did, and how far behind schedule it fell."""

    telemetry: int = 0
    ib: int = 0
    health: int = 0
    ticks: int = 0
    late_ticks: int = 0
    busy_s: float = 0.0
    telemetry_dropped: int = 0  # samples not sent while NATS was away (agents drop them too)
    health_retries: int = 0  # health publishes retried while NATS was away
    health_unsent: int = 0  # health events given up when the run ended during an outage
    injected: list[tuple[Fault, float]] = field(default_factory=list)


class SimDriver:
    """Publishes a fleet's events on a (possibly scaled) clock."""

    def __init__(
        self,
        fleet: SimFleet,
        bus: Bus,
        clock: ScaledClock,
        scenario: Scenario | None = None,
        *,
        telemetry_s: float = 1.0,
        heartbeat_s: float = 10.0,
        probe_s: float = 30.0,
        on_inject: Callable[[Fault, float], None] | None = None,
        keys: KeyRing | None = None,
    ) -> None:
        self.fleet, self.bus, self.clock = fleet, bus, clock
        # Each node's messages carry that node's MAC, as its agent's would.
        self.keys = keys
        self.pending = list(scenario.faults) if scenario else []
        self.telemetry_s, self.heartbeat_s, self.probe_s = telemetry_s, heartbeat_s, probe_s
        self.on_inject = on_inject
        self.stats = DriverStats()
        # Samples as the agents send them: format v2, a keyframe per node on its first
        # sample, when its static facts change (a power cap) and every two minutes.
        self.writer = TelemetryWriter("sim")
        self.t0 = clock.now()
        self._stop = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Tick until `stop`; each tick is one telemetry interval of simulated time."""
        # Agents answer probe requests (the engine validates remediated nodes this way).
        self._stop = stop
        sub = await self.bus.nc.subscribe(subjects.PROBE_REQUESTS, cb=self._on_probe_request)
        try:
            await self._loop(stop)
        finally:
            await sub.unsubscribe()

    async def _on_probe_request(self, msg: Any) -> None:
        node = msg.subject.split(".")[2]
        if node in self.fleet.nodes and not self.fleet.state(node)["agent_silent"]:
            nonce = requested_nonce(msg.data)
            data = self.fleet.probe(node) | ({"nonce": nonce} if nonce else {})
            await self._health(envelope("probe", node, self.clock.now(), data))

    async def _loop(self, stop: asyncio.Event) -> None:
        period = self.telemetry_s / self.clock.factor
        next_tick = time.monotonic()
        last_hb = last_probe = float("-inf")
        while not stop.is_set():
            started = time.monotonic()
            now = self.clock.now()
            self._inject(now)
            beat = now - last_hb >= self.heartbeat_s
            probe = self.probe_s > 0 and now - last_probe >= self.probe_s
            await self._tick(now, beat, probe)
            last_hb = now if beat else last_hb
            last_probe = now if probe else last_probe
            self.stats.ticks += 1
            self.stats.busy_s += time.monotonic() - started
            next_tick += period
            delay = next_tick - time.monotonic()
            if delay < 0:
                self.stats.late_ticks += 1
                next_tick = time.monotonic()
            await asyncio.sleep(max(0.0, delay))

    async def _tick(self, now: float, beat: bool, probe: bool) -> None:
        for node in self.fleet.nodes:
            sample = self.fleet.telemetry(node, now)
            if sample is None:
                continue  # a silent agent sends nothing at all
            await self._telemetry(node, now, sample["data"]["gpus"])
            ib = self.fleet.ib(node, now)
            if ib is not None:
                await self._ib(ib)
            for pending in self.fleet.take_events(node):
                await self._health(envelope(pending["kind"], node, now, pending["data"]))
            if beat:
                await self._health(envelope("heartbeat", node, now, {"seq": self.stats.ticks}))
            if probe:
                await self._health(envelope("probe", node, now, self.fleet.probe(node)))

    async def _telemetry(self, node: str, now: float, gpus: list[dict[str, Any]]) -> None:
        # While NATS is away the client's reconnect buffer fills and publish raises; an
        # agent loses such samples too (the next one replaces them), so drop and count.
        data = self.writer.encode(node, now, gpus)
        try:
            await self.bus.nc.publish(
                subject_for("telemetry", node), data, headers=self._signed(node, data)
            )
        except (NatsError, OSError):
            self.writer.lost(node)
            self.stats.telemetry_dropped += 1
            return
        self.stats.telemetry += 1

    async def _ib(self, event: dict[str, Any]) -> None:
        # Like telemetry: the agent publishes it without waiting, the next one replaces it.
        data = json.dumps(event).encode()
        try:
            await self.bus.nc.publish(
                subject_for("ib", event["node"]), data, headers=self._signed(event["node"], data)
            )
        except (NatsError, OSError):
            return
        self.stats.ib += 1

    async def _health(self, event: dict[str, Any]) -> None:
        # Health events are kept and retried until stored, as the agent's spool does; the
        # message id makes a retry of a publish whose ack was lost a duplicate, stored once.
        subject = subject_for(event["kind"], event["node"])
        data = json.dumps(event).encode()
        headers = self._signed(event["node"], data, {"Nats-Msg-Id": event["id"]})
        while True:
            try:
                await self.bus.js.publish(subject, data, headers=headers)
            except (NatsError, OSError, TimeoutError):
                if self._stop.is_set():
                    self.stats.health_unsent += 1
                    return
                self.stats.health_retries += 1
                await asyncio.sleep(1.0)
                continue
            self.stats.health += 1
            return

    def _signed(
        self, node: str, data: bytes, extra: dict[str, str] | None = None
    ) -> dict[str, str] | None:
        if self.keys is None:
            return extra
        return self.keys.node(node).headers(data, extra)

    def _inject(self, now: float) -> None:
        while self.pending and now - self.t0 >= self.pending[0].at:
            fault = self.pending.pop(0)
            self.fleet.inject(fault.node, fault.fault, fault.gpu, at=now, **fault.params)
            self.stats.injected.append((fault, now))
            log.info("injected %s on %s/%s", fault.fault, fault.node, fault.gpu)
            if self.on_inject is not None:
                self.on_inject(fault, now)
