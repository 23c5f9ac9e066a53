"""`gpuops ingest prometheus`: DCGM fields from dcgm-exporter or Prometheus, as telemetry v1.

Each scrape reads every target at once, each within its own timeout and size cap; a
target that is down, slow, too large or answers something that is not the format is
logged and counted (`gpuops_source_scrapes_total{outcome}`) and the others go on.
dcgm-exporter's text exposition is parsed by prometheus-client's parser; a Prometheus
server is asked once per scrape for every mapped metric with `/api/v1/query`.

Each series speaks for its scrape target's node, never for the node its labels name
(gpuops.sources.binding): a series forging another node, or from a target that is no
inventory host, is counted, logged and dead-lettered, never published.

Time: an event's `ts` is the injected clock's at the scrape, or the newest timestamp the
exposition carried for the node's series when it carries them (dcgm-exporter does not by
default). Prometheus's query answer is stamped with its evaluation time, not the
sample's, so a query scrape always uses the clock.

Publishing goes through a Publisher (JetStream with its ack, or memory in tests).
Telemetry is dropped while NATS is away (the next scrape replaces it); XID events wait
in a bounded on-disk spool and go out in order once NATS answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import yarl
from nats.errors import Error as NatsError
from nats.js.errors import Error as JsError
from prometheus_client import CollectorRegistry, Counter, Metric
from prometheus_client.parser import text_fd_to_metric_families
from pydantic import BaseModel, ValidationError

from gpuops.agent.spool import Spool, Spooled
from gpuops.bus.publish import Publisher
from gpuops.bus.wire import TelemetryWriter
from gpuops.clock import Clock, from_rfc3339
from gpuops.errors import ConfigError, SourceError
from gpuops.match.rules import RuleSet
from gpuops.models import subject_for
from gpuops.settings import PrometheusSourceSettings
from gpuops.sources import dcgm
from gpuops.sources.binding import Binding, Bound, Refusals, Refused, letter
from gpuops.sources.quiet import Read, Told, quiet_targets
from gpuops.sources.readings import SOURCE, Series, XidWatch, group, telemetry_event

log = logging.getLogger(__name__)

WANTED = frozenset(dcgm.metric_names())


def promql(selector: str = "") -> str:
    """The PromQL selector of every mapped metric, narrowed by `selector`'s matchers."""
    names = '__name__=~"' + "|".join(dcgm.metric_names()) + '"'
    return "{" + names + (f",{selector}" if selector else "") + "}"


class SourceMetrics:
    """The source's counters, in a registry of its own (served on `--http`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.scrapes = Counter(
            "gpuops_source_scrapes",
            "Scrapes of a target, by outcome (ok, down, timeout, too_large, http_status, garbage)",
            ["target", "outcome"],
            registry=r,
        )
        self.dropped = Counter(
            "gpuops_source_series_dropped",
            "Series not published, by reason (forged, unknown_target, not_finite, bad_gpu, ...)",
            ["reason"],
            registry=r,
        )
        self.events = Counter(
            "gpuops_source_events",
            "Events and dead letters built from scrapes, by kind and outcome (published, "
            "spooled, dropped)",
            ["kind", "outcome"],
            registry=r,
        )


# --- reading one target ---------------------------------------------------------------


async def read_capped(resp: aiohttp.ClientResponse, max_bytes: int, target: str) -> bytes:
    """The body, refused as soon as it passes `max_bytes` (after any decompression)."""
    if resp.status != 200:
        raise SourceError("http_status", f"answered HTTP {resp.status}", target=target)
    if resp.content_length is not None and resp.content_length > max_bytes:
        raise SourceError("too_large", f"{resp.content_length} bytes > {max_bytes}", target=target)
    body = bytearray()
    async for chunk in resp.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > max_bytes:
            raise SourceError("too_large", f"more than {max_bytes} bytes", target=target)
    return bytes(body)


# The parser keeps a family's samples until the family ends: a page of one huge family
# would be held whole, a few hundred bytes per line. It is fed this many lines at a time.
BATCH_LINES = 1024


def parse_exposition(
    body: bytes | str, cap: int, over: Tally[str], target: str = ""
) -> list[Series]:
    """The mapped DCGM series of a text exposition, at most `cap` (the rest counted).

    Bytes must be UTF-8 (else UnicodeDecodeError). They are decoded a line at a time and
    parsed in batches, so parsing holds the body and one batch, not the page as text (in
    a StringIO, 4 bytes a character) and as objects (a few hundred bytes a line).
    """
    if isinstance(body, bytes):
        body.decode("utf-8")  # a page that is not UTF-8 is refused whole, before any series
        lines: Iterable[str] = io.TextIOWrapper(io.BytesIO(body), "utf-8", newline="\n")
    else:
        lines = io.StringIO(body)
    out: list[Series] = []
    strings: dict[str, str] = {}
    try:
        for batch in _batches(lines):
            for family in text_fd_to_metric_families(batch):
                _keep(family, cap, over, out, strings)
    except (ValueError, IndexError, KeyError, TypeError) as exc:
        why = f"not the Prometheus text format: {exc}"
        raise SourceError("garbage", why, target=target) from exc
    return out


def _batches(lines: Iterable[str]) -> Iterator[io.StringIO]:
    """The lines in batches of BATCH_LINES, each after the last HELP and TYPE lines
    before it: the parser starts each batch in the family the previous one ended in."""
    headers: dict[str, str] = {}  # HELP/TYPE -> its last line, in the order they came
    batch = io.StringIO()
    for n, line in enumerate(lines, 1):
        batch.write(line)
        if line.lstrip().startswith("#"):
            words = line.split(None, 2)
            if len(words) > 2 and words[1] in ("HELP", "TYPE"):
                headers.pop(words[1], None)
                headers[words[1]] = line
        if n % BATCH_LINES == 0:
            batch.seek(0)
            yield batch
            batch = io.StringIO()
            batch.writelines(h if h.endswith("\n") else h + "\n" for h in headers.values())
    batch.seek(0)
    yield batch


def _keep(
    family: Metric, cap: int, over: Tally[str], out: list[Series], strings: dict[str, str]
) -> None:
    """The family's mapped samples added to `out`, up to `cap` (the rest counted); their
    label names and values are one string each in `strings` (every GPU's series repeat
    them, and kept series are what a large page costs)."""
    for s in family.samples:
        # The parser names a counter's sample `<name>_total`; DCGM's names are as is.
        counter = family.type == "counter" and s.name == family.name + "_total"
        name = family.name if counter else s.name
        if name not in WANTED:
            continue
        if len(out) >= cap:
            over["over_cap"] += 1
            continue
        ts = float(s.timestamp) if s.timestamp is not None else None
        labels = {strings.setdefault(k, k): strings.setdefault(v, v) for k, v in s.labels.items()}
        out.append(Series(name, labels, float(s.value), ts))


class _Sample(BaseModel):
    metric: dict[str, str]
    value: tuple[float, str]


class _Vector(BaseModel):
    resultType: Literal["vector"]  # Prometheus's spelling
    result: list[_Sample]


class _Answer(BaseModel):
    status: Literal["success"]
    data: _Vector


def parse_query_answer(body: bytes, cap: int, over: Tally[str], target: str = "") -> list[Series]:
    """The series of a Prometheus `/api/v1/query` answer (instant vector)."""
    try:
        answer = _Answer.model_validate_json(body)
    except ValidationError as exc:
        why = exc.errors(include_url=False)[0]
        where = ".".join(map(str, why["loc"]))
        text = f"not a query answer: {where}: {why['msg']}"
        raise SourceError("garbage", text, target=target) from exc
    out: list[Series] = []
    for sample in answer.data.result:
        name = sample.metric.get("__name__", "")
        if name not in WANTED:
            continue
        if len(out) >= cap:
            over["over_cap"] += 1
            continue
        try:
            value = float(sample.value[1])
        except ValueError:
            value = float("nan")  # counted as not finite with the others
        labels = {k: v for k, v in sample.metric.items() if k != "__name__"}
        out.append(Series(name, labels, value))
    return out


def _check_url(url: str) -> None:
    """An http(s) URL with a host, or a ConfigError naming it."""
    try:
        parsed = yarl.URL(url)
    except ValueError as exc:
        raise ConfigError(f"not a URL: {url!r} ({exc})") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ConfigError(f"not an http(s) URL with a host: {url!r}")


def check_targets(settings: PrometheusSourceSettings) -> None:
    """At least one target, each an http(s) URL, or a ConfigError saying what to give."""
    if not settings.targets and not settings.prometheus:
        raise ConfigError(
            "no target: give --target URL (dcgm-exporter) or --prometheus URL, or set "
            "sources.prometheus.targets"
        )
    for url in (*settings.targets, *([settings.prometheus] if settings.prometheus else [])):
        _check_url(url)


# At most this many targets are read at once (a fleet of exporters is read in waves).
MAX_CONNECTIONS = 64


@dataclass(frozen=True, slots=True)
class _Body:
    """A target's answer as read, before parsing; `why` says why there is none."""

    url: str
    query: bool
    body: bytes = b""
    why: str | None = None


# series, the cap's drops, and why there are none (None: the answer was read)
_Parsed = tuple[list[Series], Tally[str], str | None]


# --- the source -----------------------------------------------------------------------


@dataclass
class ScrapeReport:
    """What one scrape did: targets that failed (and why), the events it built, the
    series it placed under each node (`forwarded`) or dropped (by reason), and targets
    that answered but placed nothing (`quiet`, with why)."""

    failed: dict[str, str] = field(default_factory=dict)
    reads: list[Read] = field(default_factory=list)
    quiet: dict[str, str] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    dropped: Tally[str] = field(default_factory=Tally)
    forwarded: Tally[str] = field(default_factory=Tally)


class PromSource:
    """Scrapes the configured targets and publishes what they say, one scrape at a time."""

    def __init__(
        self,
        settings: PrometheusSourceSettings,
        binding: Binding,
        publisher: Publisher,
        clock: Clock,
        spool: Spool,
        metrics: SourceMetrics | None = None,
        connected: Callable[[], bool] = lambda: True,
        rules: RuleSet | None = None,
    ) -> None:
        """`rules`: the rules the engine runs, for the fields a feed lacks (told once)."""
        check_targets(settings)
        self.s = settings
        self.binding = binding
        self.refusals = Refusals()
        self.publisher = publisher
        self.writer = TelemetryWriter(SOURCE, version=settings.telemetry_format)
        self.clock = clock
        self.spool = spool
        self.metrics = metrics or SourceMetrics()
        self.connected = connected
        self.xids = XidWatch()
        self.told = Told(rules)

    async def scrape_once(self) -> ScrapeReport:
        """Read every target, publish one telemetry event per node and any XID changes."""
        now, report = self.clock.now(), ScrapeReport()
        bound = await self._read_all(report)
        for r in bound.refused.values():
            report.dropped[r.reason] += r.count
        report.forwarded.update({node: len(got) for node, got in bound.series.items()})
        nodes = group(bound.series, self.s.gpu_label, report.dropped)
        for node in sorted(nodes):
            report.events += self.xids.events(node, nodes[node], now)
            telemetry = telemetry_event(node, nodes[node], now, report.dropped)
            if telemetry is not None:
                report.events.append(telemetry)
        for reason, n in report.dropped.items():
            self.metrics.dropped.labels(reason).inc(n)
        report.quiet = quiet_targets(
            report.reads,
            bound.refused.values(),
            report.dropped,
            report.events,
            self.s.node_label,
            self.s.selector,
        )
        self.told.scrape(report.quiet, report.events)
        await self.publish(report.events)
        await self.dead_letters(self.refusals.news(bound.refused, report.failed), now)
        return report

    async def _read_all(self, report: ScrapeReport) -> Bound:
        timeout = aiohttp.ClientTimeout(total=self.s.timeout_s)
        gate = asyncio.Semaphore(MAX_CONNECTIONS)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            reads = [self._fetch(session, gate, url, False) for url in self.s.targets]
            if self.s.prometheus:
                reads.append(self._fetch(session, gate, self.s.prometheus, True))
            bodies = await asyncio.gather(*reads)
        # Parsing is CPU (prometheus-client's parser is pure Python): all bodies are in
        # before it starts, so no target's timeout runs while another one is parsed, and
        # it runs off the event loop (binding each series to its target's node too).
        answers, bound = await asyncio.to_thread(self._digest, bodies)
        for b, (got, over, why) in zip(bodies, answers, strict=True):
            report.dropped.update(over)
            self.metrics.scrapes.labels(b.url, why or "ok").inc()
            if why is not None:
                report.failed[b.url] = why
                continue
            node = None if b.query else self.binding.node_of_url(b.url)
            report.reads.append(Read(b.url, b.query, len(got), node))
        return bound

    def _digest(self, bodies: list[_Body]) -> tuple[list[_Parsed], Bound]:
        """Every answer parsed, and its series under their targets' nodes."""
        answers, bound = self._parse_all(bodies), Bound()
        for b, (got, _, _) in zip(bodies, answers, strict=True):
            self.binding.bind(b.url, b.query, got, bound)
        return answers, bound

    async def _fetch(
        self, session: aiohttp.ClientSession, gate: asyncio.Semaphore, url: str, query: bool
    ) -> _Body:
        """One target's answer, or why there is none: never raises."""
        try:
            async with gate:
                if query:
                    endpoint = url.rstrip("/") + "/api/v1/query"
                    params = {"query": promql(self.s.selector)}
                    async with session.get(endpoint, params=params) as resp:
                        return _Body(url, query, await read_capped(resp, self.s.max_bytes, url))
                headers = {"Accept": "text/plain;version=0.0.4"}
                async with session.get(url, headers=headers) as resp:
                    return _Body(url, query, await read_capped(resp, self.s.max_bytes, url))
        except SourceError as exc:
            log.warning("scrape %s", exc)
            return _Body(url, query, why=exc.reason)
        except TimeoutError:
            log.warning("scrape %s: no answer within %.1f s", url, self.s.timeout_s)
            return _Body(url, query, why="timeout")
        except (aiohttp.ClientError, OSError) as exc:
            log.warning("scrape %s: down (%s)", url, exc)
            return _Body(url, query, why="down")

    def _parse_all(self, bodies: list[_Body]) -> list[_Parsed]:
        """(series, dropped over the cap, failure reason or None) per target, in order."""
        out: list[_Parsed] = []
        for b in bodies:
            over: Tally[str] = Tally()
            if b.why is not None:
                out.append(([], over, b.why))
                continue
            try:
                if b.query:
                    got = parse_query_answer(b.body, self.s.max_series, over, b.url)
                else:
                    got = parse_exposition(b.body, self.s.max_series, over, b.url)
            except SourceError as exc:
                log.warning("scrape %s", exc)
                out.append(([], over, exc.reason))
            except UnicodeDecodeError as exc:
                log.warning("scrape %s: not UTF-8 (%s)", b.url, exc)
                out.append(([], over, "garbage"))
            else:
                out.append((got, over, None))
        return out

    # --- publishing ---------------------------------------------------------------

    async def publish(self, events: list[dict[str, Any]]) -> None:
        """XID events through the spool, in order; telemetry only while NATS answers."""
        up = await self.flush_spool()
        for event in events:
            kind, node = event["kind"], event["node"]
            if kind == "telemetry":
                up = up and await self._telemetry(event)
                self.metrics.events.labels(kind, "published" if up else "dropped").inc()
                continue
            item = Spooled(subject_for(kind, node), json.dumps(event), event["id"])
            if up and await self._send(item):
                self.metrics.events.labels(kind, "published").inc()
                continue
            up = False  # one failure is enough: the rest would each wait for a timeout
            self.spool.push(item)
            self.metrics.events.labels(kind, "spooled").inc()

    async def dead_letters(self, refused: list[Refused], at: float) -> None:
        """A dead letter per refusal that just began; lost while NATS is away (the counts stay)."""
        for r in refused:
            sent = await self._send(letter(r, at))
            self.metrics.events.labels("dead_letter", "published" if sent else "dropped").inc()

    async def flush_spool(self) -> bool:
        """Publish held events in order; False when one failed (NATS is still away)."""
        return await self.spool.flush(self._send)

    async def _telemetry(self, event: dict[str, Any]) -> bool:
        """A sample in the configured format, never spooled (the next one replaces it); a
        lost one makes the node's next sample a keyframe."""
        node = event["node"]
        t = from_rfc3339(event["ts"])  # the time the sample was made with
        payload = self.writer.encode(node, t, event["data"]["gpus"], event["id"])
        if await self._publish(subject_for("telemetry", node), payload, event["id"]):
            return True
        self.writer.lost(node)
        return False

    async def _send(self, item: Spooled) -> bool:
        return await self._publish(item.subject, item.payload.encode(), item.msg_id)

    async def _publish(self, subject: str, payload: bytes, msg_id: str | None) -> bool:
        if not self.connected():
            return False
        try:
            await self.publisher.publish(subject, payload, msg_id)
        except (NatsError, JsError, TimeoutError, OSError) as exc:
            log.warning("publish to %s failed (%s)", subject, exc)
            return False
        return True

    async def run(self, stop: asyncio.Event) -> None:
        """Scrape every interval until `stop`; a failed scrape is logged, the next one runs."""
        while not stop.is_set():
            started = time.monotonic()
            try:
                report = await self.scrape_once()
                failed = report.failed or "none"
                log.info("scrape: %d events, failed: %s", len(report.events), failed)
            except Exception:
                log.exception("scrape failed")
            left = self.s.interval_s - (time.monotonic() - started)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(left, 0.0))
