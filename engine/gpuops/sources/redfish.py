"""Facility telemetry over Redfish: chassis inlet temperatures, fans and PSU power from a
server's BMC, and a cooling unit's supply and return temperatures, flow, pumps and leak
detectors (Redfish 2023.2's ThermalEquipment, CoolingUnit and LeakDetection), as
`facility` events about the inventory host each service speaks for, with its failure
domains (rack, PDU, cooling loop) attached.

The reads are plain GETs with HTTP basic authentication (no session left behind on the
BMC) over urllib3, which streams: this module walks the resources a BMC or CDU links
from its service root, reads each into the few numbers that matter, and bounds what it
reads: at most `max_documents` documents per poll, each read in chunks and dropped as
soon as it passes `max_bytes` (DMTF's `redfish` client reads a whole answer before
anyone can look at its size), every value validated by the event model. https targets
must name the CA that signed their certificate (the settings refuse them otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import urllib3
from pydantic import ValidationError

from gpuops.bus.publish import Publisher
from gpuops.clock import Clock, rfc3339
from gpuops.errors import SourceError
from gpuops.inventory.hosts import Inventory
from gpuops.models import EVENT_ADAPTER, subject_for
from gpuops.settings import RedfishSourceSettings, RedfishTarget

log = logging.getLogger(__name__)
ROOT = "/redfish/v1"
CHUNK = 1 << 16  # a body is read this much at a time, so at most this past max_bytes
SOURCE = "redfish"
DOMAIN_VARS = ("rack", "pdu", "cooling_loop")


@dataclass(frozen=True, slots=True)
class Reading:
    """One number or state a service reported, named within its node."""

    sensor: str
    metric: str
    value: float | None
    resource: str
    state: str | None = None


@dataclass(frozen=True, slots=True)
class Answer:
    """One GET's status and, for a 200, its body (never more than the limit)."""

    status: int
    body: bytes = b""


class Client(Protocol):
    """What the reader needs of a Redfish client."""

    def get(self, path: str) -> Answer: ...

    def close(self) -> None: ...


class Http:
    """GETs to one Redfish service, each body refused as soon as it passes `max_bytes`,
    and all of them by `deadline` (time.monotonic()): a BMC that answers every read just
    within `timeout_s` (a byte at a time) would otherwise hold its thread for as long as
    it likes, and each poll would start another."""

    def __init__(
        self, target: RedfishTarget, timeout_s: float, max_bytes: int, deadline: float
    ) -> None:
        password = target.password_file.read_text().strip() if target.password_file else ""
        headers = urllib3.make_headers(basic_auth=f"{target.user}:{password}")
        headers |= {"Accept": "application/json", "OData-Version": "4.0"}
        self.url, self.max_bytes = target.url, max_bytes
        self.timeout_s, self.deadline = timeout_s, deadline
        self.pool = urllib3.PoolManager(
            headers=headers,
            retries=urllib3.Retry(connect=1, read=1, redirect=5, raise_on_redirect=False),
            ca_certs=str(target.ca) if target.ca else None,
        )

    def _left(self, path: str) -> float:
        """Seconds a wait may last now: `timeout_s`, or less near the deadline."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise SourceError("slow", f"GET {path}: not read within the poll", target=self.url)
        return min(self.timeout_s, left)

    def get(self, path: str) -> Answer:
        """The answer to `GET path`; its body read only when it is a 200."""
        wait = self._left(path)
        resp = self.pool.request(
            "GET",
            self.url + path,
            preload_content=False,
            timeout=urllib3.Timeout(connect=wait, read=wait),
        )
        if resp.status != 200:
            resp.close()  # its body is not read, so the connection cannot carry another
            return Answer(resp.status)
        try:
            body = self._read(resp, path)
        except BaseException:
            resp.close()  # the rest is unread, as above
            raise
        resp.release_conn()
        return Answer(200, body)

    def _read(self, resp: urllib3.BaseHTTPResponse, path: str) -> bytes:
        too_large = f"GET {path}: more than max_bytes ({self.max_bytes} bytes)"
        length = resp.headers.get("Content-Length", "")
        if length.isdigit() and int(length) > self.max_bytes:
            raise SourceError("too_large", f"{too_large}: {length}", target=self.url)
        body = bytearray()
        # read1: what one socket read brought (decompressed, CHUNK at most), so the
        # deadline is looked at after every wait, not after a whole trickled CHUNK.
        while chunk := resp.read1(CHUNK):
            body += chunk
            if len(body) > self.max_bytes:
                raise SourceError("too_large", too_large, target=self.url)
            self._left(path)
        return bytes(body)

    def close(self) -> None:
        """Close the pooled connections."""
        self.pool.clear()


class Reader:
    """Reads one service's facility resources into readings, within the bounds."""

    def __init__(self, client: Client, url: str, max_documents: int) -> None:
        self.client, self.url, self.left = client, url, max_documents

    def get(self, path: str) -> dict[str, Any]:
        """One document, bounded and a JSON object, else a SourceError naming it."""
        if self.left <= 0:
            raise SourceError("too_many", f"{self.url}: more documents than max_documents")
        self.left -= 1
        answer = self.client.get(path)
        if answer.status != 200:
            raise SourceError("answer", f"{self.url}{path}: HTTP {answer.status}")
        try:
            body = json.loads(answer.body)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            raise SourceError("answer", f"{self.url}{path}: not a JSON object")
        return body

    def linked(self, doc: dict[str, Any], key: str) -> dict[str, Any] | None:
        """The document `doc[key]` links to, if it links one."""
        link = doc.get(key)
        target = link.get("@odata.id") if isinstance(link, dict) else None
        return self.get(target) if isinstance(target, str) and target.startswith(ROOT) else None

    def members(self, collection: dict[str, Any] | None) -> Iterator[dict[str, Any]]:
        """The members of a collection document, each read."""
        for member in (collection or {}).get("Members", []) or []:
            target = member.get("@odata.id") if isinstance(member, dict) else None
            if isinstance(target, str) and target.startswith(ROOT):
                yield self.get(target)

    def readings(self) -> list[Reading]:
        """Everything the service links from its root that gpuops reads."""
        root = self.get(ROOT)
        out: list[Reading] = []
        for chassis in self.members(self.linked(root, "Chassis")):
            out += self._chassis(chassis)
        equipment = self.linked(root, "ThermalEquipment")
        if equipment is not None:
            for cdu in self.members(self.linked(equipment, "CDUs")):
                out += self._cooling_unit(cdu)
        return out

    def _chassis(self, chassis: dict[str, Any]) -> list[Reading]:
        name = _id(chassis)
        out: list[Reading] = []
        thermal = self.linked(chassis, "Thermal")
        for t in (thermal or {}).get("Temperatures", []) or []:
            if isinstance(t, dict) and t.get("PhysicalContext") == "Intake":
                out.append(_of(f"{name}/{_label(t)}", "inlet_temp_c", t, "ReadingCelsius"))
        for fan in (thermal or {}).get("Fans", []) or []:
            if isinstance(fan, dict) and fan.get("ReadingUnits", "RPM") == "RPM":
                out.append(_of(f"{name}/{_label(fan)}", "fan_rpm", fan, "Reading"))
        power = self.linked(chassis, "Power")
        for control in (power or {}).get("PowerControl", []) or []:
            if isinstance(control, dict):
                sensor = f"{name}/{_label(control)}"
                out.append(_of(sensor, "power_consumed_w", control, "PowerConsumedWatts"))
        for psu in (power or {}).get("PowerSupplies", []) or []:
            if isinstance(psu, dict):
                out.append(_of(f"{name}/{_label(psu)}", "psu_input_w", psu, "PowerInputWatts"))
        subsystem = self.linked(chassis, "ThermalSubsystem")
        if subsystem is not None:
            out += self._leaks(name, self.linked(subsystem, "LeakDetection"))
        return out

    def _cooling_unit(self, cdu: dict[str, Any]) -> list[Reading]:
        name = f"cdu-{_id(cdu)}"
        out: list[Reading] = []
        for connector in self.members(self.linked(cdu, "PrimaryCoolantConnectors")):
            base = f"{name}/primary-{_id(connector)}"
            for key, metric in (
                ("SupplyTemperatureCelsius", "supply_temp_c"),
                ("ReturnTemperatureCelsius", "return_temp_c"),
                ("FlowLitersPerMinute", "flow_lpm"),
            ):
                if isinstance(connector.get(key), dict):
                    out.append(_excerpt(f"{base}/{metric}", metric, connector, key))
        for pump in self.members(self.linked(cdu, "Pumps")):
            if isinstance(pump.get("PumpSpeedPercent"), dict):
                sensor = f"{name}/pump-{_id(pump)}"
                out.append(_excerpt(sensor, "pump_speed_pct", pump, "PumpSpeedPercent"))
        return out + self._leaks(name, self.linked(cdu, "LeakDetection"))

    def _leaks(self, base: str, detection: dict[str, Any] | None) -> list[Reading]:
        if detection is None:
            return []
        return [
            Reading(
                sensor=f"{base}/leak-{_id(d)}",
                metric="leak",
                value=None,
                resource=str(d.get("@odata.id", "")),
                state=_state(d.get("DetectorState")),
            )
            for d in self.members(self.linked(detection, "LeakDetectors"))
        ]


def _id(doc: dict[str, Any]) -> str:
    return str(doc.get("Id") or doc.get("@odata.id", "?").rstrip("/").rsplit("/", 1)[-1])[:48]


def _label(member: dict[str, Any]) -> str:
    """A member of an array (a temperature, a fan, a PSU) by its name, made a token."""
    raw = str(member.get("Name") or member.get("MemberId") or "?")
    return "-".join(raw.lower().split())[:48]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _of(sensor: str, metric: str, doc: dict[str, Any], key: str) -> Reading:
    return Reading(sensor, metric, _number(doc.get(key)), str(doc.get("@odata.id", "")))


def _excerpt(sensor: str, metric: str, doc: dict[str, Any], key: str) -> Reading:
    """A Redfish SensorExcerpt (`{"Reading": 32.0, "DataSourceUri": ...}`)."""
    excerpt = doc[key]
    source = excerpt.get("DataSourceUri") or doc.get("@odata.id", "")
    return Reading(sensor, metric, _number(excerpt.get("Reading")), str(source))


def _state(value: Any) -> str:
    return value if value in ("OK", "Warning", "Critical") else "Unavailable"


def read_target(target: RedfishTarget, cfg: RedfishSourceSettings) -> list[Reading]:
    """Read every document the service links (blocking: the source runs it in a thread),
    within one poll's interval (past it, at most one wait of `timeout_s` more)."""
    deadline = time.monotonic() + cfg.interval_s
    client = Http(target, cfg.timeout_s, cfg.max_bytes, deadline)
    try:
        return Reader(client, target.url, cfg.max_documents).readings()
    except SourceError:
        raise
    except Exception as exc:  # no answer, a refused certificate, a connection that broke
        raise SourceError("down", f"{target.url}: {type(exc).__name__}: {exc}") from None
    finally:
        client.close()


def events_of(
    target: RedfishTarget, readings: list[Reading], inventory: Inventory, at: float
) -> list[dict[str, Any]]:
    """The readings as facility events about the target's node, each validated."""
    hostvars = inventory.hostvars.get(target.node, {})
    domains = {k: str(hostvars[k]) for k in DOMAIN_VARS if hostvars.get(k) not in (None, "")}
    out = []
    for r in readings:
        data: dict[str, Any] = {"sensor": r.sensor, "metric": r.metric, "resource": r.resource}
        data |= {"value": r.value} if r.value is not None else {}
        data |= {"state": r.state} if r.state is not None else {}
        key = hashlib.sha256(f"{target.node}\0{r.sensor}".encode()).hexdigest()[:32]
        event = {
            "id": f"{SOURCE}-{key}-{int(at * 1000)}",
            "node": target.node,
            "ts": rfc3339(at),
            "source": f"{SOURCE}:{target.url}"[:200],
            "kind": "facility",
            "data": data | domains,
        }
        try:
            EVENT_ADAPTER.validate_python(event)  # what the engine would dead-letter is not sent
        except ValidationError as exc:  # one odd reading costs itself, not the poll
            log.warning("redfish %s %s not published: %s", target.node, r.sensor, exc)
            continue
        out.append(event)
    return out


Read = Callable[[RedfishTarget, RedfishSourceSettings], list[Reading]]


def _retrieved(done: asyncio.Future[list[Reading]]) -> None:
    """Take a read's error, so that one which ended after its poll stopped waiting is not
    logged as never retrieved (the poll that waited already logged it)."""
    if not done.cancelled():
        done.exception()


class RedfishSource:
    """Polls every target each interval and publishes its readings; a target that does not
    answer is logged and tried again next interval, and so is NATS."""

    def __init__(
        self,
        cfg: RedfishSourceSettings,
        inventory: Inventory,
        publisher: Publisher,
        clock: Clock,
        read: Read = read_target,
    ) -> None:
        for target in cfg.targets:
            if target.node not in inventory:
                why = f"{target.node} is not in the inventory"
                raise SourceError("unknown_node", why, target=target.url)
        self.cfg, self.inventory, self.publisher, self.clock = cfg, inventory, publisher, clock
        self.read = read
        self.failed: dict[str, str] = {}  # target url -> why, for the last poll
        self._reading: dict[str, asyncio.Future[list[Reading]]] = {}  # url -> its read

    async def poll_once(self) -> list[dict[str, Any]]:
        """Every target once, concurrently; the events published."""
        results = await asyncio.gather(
            *(self._read_one(t) for t in self.cfg.targets), return_exceptions=True
        )
        now, events = self.clock.now(), []
        self.failed = {}
        for target, result in zip(self.cfg.targets, results, strict=True):
            if isinstance(result, BaseException):
                self.failed[target.url] = str(result) or type(result).__name__
                log.warning("redfish %s (%s): %s", target.url, target.node, result)
                continue
            events += events_of(target, result, self.inventory, now)
        for event in events:
            payload = json.dumps(event, separators=(",", ":")).encode()
            await self.publisher.publish(
                subject_for("facility", event["node"]), payload, event["id"]
            )
        return events

    async def _read_one(self, target: RedfishTarget) -> list[Reading]:
        """One target's readings in a worker thread, waited for one interval at most.

        A thread cannot be stopped: one that outlives the wait goes on to its own
        deadline (read_target's), and until it ends the target is not read again, so a
        slow BMC holds one thread, never one more a poll."""
        running = self._reading.get(target.url)
        if running is not None and not running.done():
            raise SourceError("slow", f"{target.url}: still reading from the last poll")
        reading = asyncio.ensure_future(asyncio.to_thread(self.read, target, self.cfg))
        reading.add_done_callback(_retrieved)  # its error is the poll's, or no one's
        self._reading[target.url] = reading
        return await asyncio.wait_for(asyncio.shield(reading), self.cfg.interval_s)

    async def run(self, stop: asyncio.Event) -> None:
        """Poll until `stop`; NATS or a target away costs that poll, never the loop."""
        while not stop.is_set():
            try:
                await self.poll_once()
            except Exception as exc:  # the bus went away mid-publish: the next poll resends
                log.warning("redfish poll not published: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.cfg.interval_s)
