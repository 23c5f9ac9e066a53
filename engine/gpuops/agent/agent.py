"""The node agent: telemetry on an interval, health events at once, heartbeats, probes.

Health events are published to JetStream with `Nats-Msg-Id` and the store's ack awaited;
when that fails they go to the spool and are flushed in order once NATS answers again.
Telemetry is published without waiting: a lost sample is replaced by the next one.
Heartbeats are not spooled either, for the same reason: an outage's would push its XIDs
out of the spool.
The client may still be connecting when the agent starts (NATS down at boot): sampling
and spooling begin at once, and the spool drains when the connection comes up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nats.aio.client import Client
from nats.errors import Error as NatsError
from nats.js.errors import Error as JsError

from gpuops import __version__, subjects
from gpuops.agent.backend import GpuBackend, HealthSignal
from gpuops.agent.infiniband import read_ib
from gpuops.agent.kmsg import KmsgParser, KmsgReader
from gpuops.agent.probe import requested_nonce, run_probe
from gpuops.agent.spool import Spool, Spooled
from gpuops.agent.topology import observe
from gpuops.bus.identity import Signer
from gpuops.bus.wire import KEYFRAME_EVERY_S, TelemetryWriter
from gpuops.clock import Clock
from gpuops.diagnose.topology import differences, load_manifest
from gpuops.errors import EngineError
from gpuops.models import new_event, subject_for

log = logging.getLogger(__name__)

# A failing NVML event wait (a lost GPU's answer) is tried again after this pause, and
# warned of once, then once per EVENT_WARN_EVERY_S while it goes on failing.
EVENT_RETRY_S = 1.0
EVENT_WARN_EVERY_S = 300.0


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """How often the agent does what."""

    node: str
    interval_s: float = 10.0
    heartbeat_s: float = 30.0
    probe_every_s: float = 3600.0
    probe_timeout_s: float = 60.0
    probe_command: tuple[str, ...] = ()
    spool_path: Path = Path("/var/lib/gpuops/agent-spool.jsonl")
    spool_max: int = 10_000
    ib_root: Path | None = None  # /sys/class/infiniband: an `ib` event per interval
    kmsg_path: Path | None = None  # /dev/kmsg: XIDs and SXids from the kernel log
    # The same XID from NVML's event path and the kernel log, or the driver's several
    # lines for one XID, arrive within seconds: report a (gpu, xid) once per window.
    xid_dedupe_s: float = 30.0
    # A steady, healthy InfiniBand summary is repeated this often; a change, or a port
    # down, goes out every interval (the events stream keeps a week: 8 ports every 10 s
    # on every node would fill it with nothing new).
    ib_every_s: float = 300.0
    # The topology manifest the node is held to (gpuops.diagnose.topology), checked on the
    # first sample and then this often; each difference is a `topology` event.
    topology: Path | None = None
    topology_every_s: float = 300.0
    sys_root: Path = Path("/sys")
    # Telemetry format: 2 (static facts in a keyframe, readings as arrays; gpuops.bus.wire)
    # or 1 (every field every sample, for an engine older than v2). A v2 keyframe goes
    # out on start, on a change, after NATS was away, and this often.
    telemetry_format: int = 2
    keyframe_every_s: float = KEYFRAME_EVERY_S


def event(
    kind: str, node: str, t: float, data: dict[str, Any], source: str = "agent"
) -> dict[str, Any]:
    """An event in format v1 from this agent (source `agent`, or `kmsg` from the kernel log)."""
    return new_event(kind, node, t, data, source)


class _Repeats:
    """A failure that repeats, warned of on its first time and then once per `every_s`
    with the count since (a warning per try would bury the log)."""

    def __init__(self, what: str, clock: Clock, every_s: float) -> None:
        self.what, self.clock, self.every_s = what, clock, every_s
        self.count = 0
        self._warned_at = float("-inf")

    def failed(self, exc: Exception) -> None:
        """One more failure: warn when it is the first, or the last warning is old."""
        self.count += 1
        now = self.clock.now()
        if self.count > 1 and now - self._warned_at < self.every_s:
            return
        self._warned_at = now
        log.warning(
            "%s failed (%s), %d in a row; trying again",
            self.what,
            exc,
            self.count,
            exc_info=not isinstance(exc, EngineError),  # a bug's traceback; NVML's says it all
        )

    def mended(self) -> None:
        """It worked: say so when it had been failing."""
        if self.count:
            log.info("%s works again after %d failures", self.what, self.count)
        self.count = 0
        self._warned_at = float("-inf")


def default_node() -> str:
    """This host's short name, as inventories usually spell it."""
    return socket.gethostname().split(".")[0]


class Agent:
    """Runs the agent's loops against one backend and one NATS connection."""

    def __init__(
        self,
        settings: AgentSettings,
        backend: GpuBackend,
        nc: Client,
        clock: Clock,
        signer: Signer | None = None,
    ) -> None:
        self.s = settings
        self.backend = backend
        # Every message says it is this node's, with the node's own key (gpuops.bus.identity).
        self.signer = signer
        self.nc = nc
        self.js = nc.jetstream(timeout=5)
        self.clock = clock
        self.spool = Spool(settings.spool_path, settings.spool_max)
        self.writer = TelemetryWriter(
            "agent", version=settings.telemetry_format, every_s=settings.keyframe_every_s
        )
        self.seq = 0
        self.sent: dict[str, int] = {}
        self._signals: asyncio.Queue[HealthSignal] = asyncio.Queue()
        self._xid_seen: dict[tuple[Any, Any], float] = {}
        self.xid_duplicates = 0
        self.kmsg = KmsgParser(backend.pci_bus_ids)
        self._ib_last: tuple[Any, ...] | None = None
        self._ib_sent_at = float("-inf")
        self._ib_seen_up: set[str] = set()  # ports seen ACTIVE: only they can be "down"
        # A manifest that does not read stops the agent at start, saying which file.
        manifest = load_manifest(settings.topology) if settings.topology else None
        self.topology = manifest.for_host(settings.node) if manifest else None
        self._topology_at = float("-inf")

    async def run(self, stop: asyncio.Event) -> None:
        """All loops until `stop`; they sample and spool from the start, connected or not."""
        loop = asyncio.get_running_loop()
        halt = threading.Event()
        listener = threading.Thread(
            target=self._listen, args=(loop, halt), daemon=True, name="nvml-events"
        )
        listener.start()
        if self.s.kmsg_path is not None:

            def emit(signal: HealthSignal) -> None:
                loop.call_soon_threadsafe(self._signals.put_nowait, signal)

            reader = KmsgReader(self.s.kmsg_path, self.kmsg)
            threading.Thread(
                target=reader.follow, args=(halt, emit), daemon=True, name="kmsg"
            ).start()
        try:
            await asyncio.gather(
                self._every(self.s.interval_s, self.publish_telemetry, stop),
                self._every(self.s.interval_s, self.publish_ib, stop),
                self._every(self.s.heartbeat_s, self.publish_heartbeat, stop),
                self._every(self.s.probe_every_s, self.probe, stop),
                self._every(2.0, self.flush_spool, stop),
                self._drain_signals(stop),
                self._serve_probe_requests(stop),
            )
        finally:
            halt.set()

    async def _serve_probe_requests(self, stop: asyncio.Event) -> None:
        """Answer probe requests once connected (the client resubscribes after reconnects)."""
        while not self.nc.is_connected:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.2)
            if stop.is_set():
                return
        sub = await self.nc.subscribe(
            subjects.probe_request(self.s.node), cb=self._on_probe_request
        )
        await stop.wait()
        with contextlib.suppress(NatsError):
            await sub.unsubscribe()

    async def _every(self, period: float, step: Any, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await step()
            except Exception:
                log.exception("agent step %s failed", getattr(step, "__name__", step))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), period)

    def _listen(self, loop: asyncio.AbstractEventLoop, halt: threading.Event) -> None:
        """Thread: wait on NVML events with a short timeout so stopping is prompt."""
        failures = _Repeats("NVML event wait", self.clock, EVENT_WARN_EVERY_S)
        while not halt.is_set():
            try:
                signals = self.backend.wait_events(200)
            except Exception as exc:  # a failing wait answers at once: pause, or it spins
                failures.failed(exc)
                halt.wait(EVENT_RETRY_S)
                continue
            failures.mended()
            for signal in signals:
                loop.call_soon_threadsafe(self._signals.put_nowait, signal)

    async def _drain_signals(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                signal = await asyncio.wait_for(self._signals.get(), 0.5)
            except TimeoutError:
                continue
            try:
                if not self._duplicate(signal):
                    await self.publish_health(signal.kind, signal.data, signal.source)
            except Exception:  # like _every: one signal that fails must not end the agent
                log.exception("health signal %s from %s not published", signal.kind, signal.source)

    def _duplicate(self, signal: HealthSignal) -> bool:
        """An XID for a (gpu, xid) already reported within `xid_dedupe_s`, by either path."""
        if signal.kind != "xid":
            return False
        now, window = self.clock.now(), self.s.xid_dedupe_s
        self._xid_seen = {k: t for k, t in self._xid_seen.items() if now - t < window}
        key = (signal.data.get("gpu"), signal.data.get("xid"))
        if key in self._xid_seen:
            self.xid_duplicates += 1
            log.info("XID %s on GPU %s from %s already reported", key[1], key[0], signal.source)
            return True
        self._xid_seen[key] = now
        return False

    async def publish_telemetry(self) -> None:
        """One sample of every GPU; a GPU found lost goes out as a health event at once."""
        gpus, signals = await asyncio.to_thread(self.backend.sample)
        for signal in signals:
            await self.publish_health(signal.kind, signal.data)
        if gpus:
            await self.check_topology(gpus)
        node = self.s.node
        if not gpus or not self.nc.is_connected:
            self.writer.lost(node)  # once NATS answers, the first sample has the facts
            return  # not spooled: the next sample replaces it
        data = self.writer.encode(node, self.clock.now(), gpus)
        try:
            await self.nc.publish(subject_for("telemetry", node), data, headers=self._headers(data))
        except NatsError:  # not spooled: the next sample replaces it
            self.writer.lost(node)
            return
        self.sent["telemetry"] = self.sent.get("telemetry", 0) + 1

    async def check_topology(self, gpus: list[dict[str, Any]]) -> None:
        """The node against its manifest, on the first sample and every `topology_every_s`
        after: each difference a health event (spooled, like an XID)."""
        now = self.clock.now()
        if self.topology is None or now - self._topology_at < self.s.topology_every_s:
            return
        self._topology_at = now
        ib = read_ib(self.s.ib_root) if self.s.ib_root is not None else None
        seen = await asyncio.to_thread(
            observe, gpus, self.backend.pci_bus_ids(), self.s.sys_root, ib, self.s.ib_root
        )
        util = {int(g["index"]): g.get("util_gpu") for g in gpus}
        for found in differences(self.topology, seen, util):
            await self.publish_health("topology", found.model_dump(mode="json"))

    async def publish_ib(self) -> None:
        """The node's InfiniBand ports: on a change or a port down, else every `ib_every_s`.

        Like telemetry it is not spooled: the next one replaces a lost one.
        """
        if self.s.ib_root is None or not self.nc.is_connected:
            return
        data = await asyncio.to_thread(read_ib, self.s.ib_root, self._ib_seen_up)
        if data is None:
            return  # no InfiniBand here: nothing to say, and not a fault
        now = self.clock.now()
        summary = tuple(v for k, v in sorted(data.items()) if k != "detail")
        steady = summary == self._ib_last and not data["ports_down"]
        if steady and now - self._ib_sent_at < self.s.ib_every_s:
            return
        body = json.dumps(event("ib", self.s.node, now, data)).encode()
        with contextlib.suppress(NatsError):
            await self.nc.publish(subject_for("ib", self.s.node), body, headers=self._headers(body))
            self.sent["ib"] = self.sent.get("ib", 0) + 1
            self._ib_last, self._ib_sent_at = summary, now

    async def publish_heartbeat(self) -> None:
        """I am alive (and how many spooled events I had to drop).

        Never spooled: the next heartbeat replaces a lost one, and an outage's heartbeats
        would push its XIDs out of the spool. Nor sent ahead of held events: those first.
        """
        self.seq += 1
        data = {"seq": self.seq, "agent_version": __version__, "spool_dropped": self.spool.dropped}
        if not len(self.spool) and await self._send(self._item("heartbeat", data)):
            self._count("heartbeat")

    async def probe(self, nonce: str | None = None) -> None:
        """Run the known-answer probe on every GPU and publish each result (echoing the
        validation request's nonce, when one asked)."""
        gpus = list(range(self.backend.gpu_count()))
        command = list(self.s.probe_command) or None
        for result in await asyncio.to_thread(run_probe, gpus, self.s.probe_timeout_s, command):
            data = {
                k: v
                for k, v in result.items()
                if k in ("gpu", "ok", "outcome", "error", "duration_s")
            }
            # A scheduled pass is replaced by the next hour's: a full spool drops it before
            # a fault. A failure, or an answer to a validation request, is kept like an XID.
            passed = data.get("ok") is True and not nonce
            await self.publish_health(
                "probe", data | ({"nonce": nonce} if nonce else {}), replaceable=passed
            )

    async def _on_probe_request(self, msg: Any) -> None:
        await self.probe(requested_nonce(msg.data))
        if msg.reply:
            await self.nc.publish(msg.reply, b"probed")

    async def publish_health(
        self, kind: str, data: dict[str, Any], source: str = "agent", replaceable: bool = False
    ) -> None:
        """Publish with a message id and an awaited ack; spool if that fails (`replaceable`:
        a full spool drops it before any event that is not)."""
        item = self._item(kind, data, source, replaceable)
        if len(self.spool) or not await self._send(item):
            self.spool.push(item)  # keep order: nothing overtakes what is already spooled
            return
        self._count(kind)

    def _item(
        self, kind: str, data: dict[str, Any], source: str = "agent", replaceable: bool = False
    ) -> Spooled:
        payload = event(kind, self.s.node, self.clock.now(), data, source)
        subject = subject_for(kind, self.s.node)
        return Spooled(subject, json.dumps(payload), payload["id"], replaceable)

    def _count(self, kind: str) -> None:
        self.sent[kind] = self.sent.get(kind, 0) + 1

    def _headers(self, data: bytes, extra: dict[str, str] | None = None) -> dict[str, str] | None:
        if self.signer is None:
            return extra
        return self.signer.headers(data, extra)

    async def flush_spool(self) -> None:
        """Publish held events in order; stop at the first that fails."""
        await self.spool.flush(self._send)

    async def _send(self, item: Spooled) -> bool:
        if not self.nc.is_connected:
            return False
        data = item.payload.encode()
        try:
            await self.js.publish(
                item.subject, data, headers=self._headers(data, {"Nats-Msg-Id": item.msg_id})
            )
        except (NatsError, JsError, TimeoutError) as exc:
            log.warning("publish to %s failed (%s)", item.subject, exc)
            return False
        return True
