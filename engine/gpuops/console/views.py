"""What the console's pages show, read from the streams: a node's timeline from the audit
trail and its recent telemetry, each bounded (a window of time and a count)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from gpuops import subjects
from gpuops.bus.conn import AUDIT, TELEMETRY
from gpuops.bus.reader import one_read
from gpuops.clock import rfc3339
from gpuops.models import EVENT_ADAPTER, AuditRecord, TelemetryEvent

log = logging.getLogger(__name__)

MAX_TIMELINE = 300  # the newest records of a node's window
MAX_SAMPLES = 360  # per GPU chart: the telemetry stream keeps ten minutes anyway
CHART_FIELDS = ("temp_c", "power_w", "util_gpu", "dram_bw_util")
# Built-in rules (gpuops/match/builtin.py) whose decisions are a node's validation.
VALIDATION_RULES = frozenset({"validation-passed", "validation-failed"})
FACTS_SHOWN = 6
# Facts that name a GPU rather than say what was wrong with it: not worth a timeline's room.
FACTS_NOT_SHOWN = frozenset({"index", "uuid", "name", "labels", "node"})


async def read_since(
    js: JetStreamContext, stream: str, subject: str, since: float, limit: int
) -> AsyncIterator[bytes]:
    """Payloads on `subject` stored after `since` (epoch s), oldest first, at most `limit`."""
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_TIME,
        opt_start_time=datetime.fromtimestamp(since, UTC),
    )
    try:
        async with one_read(js, subject, stream, config) as sub:
            left = (await sub.consumer_info()).num_pending or 0
            while left > 0 and limit > 0:
                try:
                    msgs = await sub.fetch(min(256, left, limit), timeout=1.0)
                except (NatsTimeout, TimeoutError):
                    return
                for msg in msgs:
                    yield msg.data
                left, limit = msgs[-1].metadata.num_pending or 0, limit - len(msgs)
    except NotFoundError:
        return


@dataclass(frozen=True, slots=True)
class Entry:
    """One line of a node's timeline."""

    at: float
    kind: str  # fault | decision | drop | run | validation | note
    rule: str
    title: str
    detail: str = ""
    facts: dict[str, Any] = field(default_factory=dict)
    run_id: str | None = None
    revision: str | None = None
    outcome: str | None = None

    @property
    def when(self) -> str:
        """UTC time to the second."""
        return rfc3339(self.at)[:19].replace("T", " ")


def entry(record: AuditRecord) -> Entry:
    """A timeline entry for one audit record."""
    if record.type == "run":
        return _run_entry(record)
    if record.type != "decision":
        return Entry(record.at, "note", record.rule, record.summary)
    d = record.body.get("decision", {})
    reason, detail = str(d.get("reason", "")), str(d.get("detail", ""))
    said = (kv for kv in record.body.get("facts", {}).items() if kv[0] not in FACTS_NOT_SHOWN)
    facts = dict(list(said)[:FACTS_SHOWN])
    if record.rule in VALIDATION_RULES:
        kind = "validation"
    elif d.get("accepted") or reason in ("approval_pending", "no_action", "needs_human"):
        kind = "fault"
    else:
        kind = "drop"
    why = f"{reason}: {detail}" if detail else reason
    return Entry(record.at, kind, record.rule, record.summary, why, facts)


def _run_entry(record: AuditRecord) -> Entry:
    b = record.body
    failed = f"task {b['failed_task']!r}: {b.get('failed_message') or '-'}"
    return Entry(
        record.at,
        "run",
        record.rule,
        record.summary,
        failed if b.get("failed_task") else "",
        run_id=b.get("run_id"),
        revision=b.get("revision"),
        outcome=b.get("status"),
    )


async def timeline(js: JetStreamContext, node: str, since: float) -> list[Entry]:
    """The node's audit records after `since` as entries, oldest first (the newest few hundred)."""
    newest: deque[Entry] = deque(maxlen=MAX_TIMELINE)
    async for data in read_since(js, AUDIT, subjects.audit(node), since, 100_000):
        try:
            newest.append(entry(AuditRecord.model_validate_json(data)))
        except ValueError:
            log.warning("unreadable audit record of %s skipped", node)
    return list(newest)


async def telemetry(js: JetStreamContext, node: str, since: float) -> dict[str, Any]:
    """`{"fields": [...], "gpus": {index: [[t...], [field...]...]}}` for uPlot, per GPU."""
    series: dict[int, list[list[float | None]]] = {}
    subject = subjects.stored_telemetry(node)
    async for data in read_since(js, TELEMETRY, subject, since, MAX_SAMPLES * 4):
        try:
            event = EVENT_ADAPTER.validate_json(data)
        except ValueError:
            continue
        if not isinstance(event, TelemetryEvent) or event.node != node:
            continue
        for gpu in event.data.gpus:
            columns = series.setdefault(gpu.index, [[] for _ in range(len(CHART_FIELDS) + 1)])
            columns[0].append(round(event.epoch, 1))
            for col, name in zip(columns[1:], CHART_FIELDS, strict=True):
                col.append(getattr(gpu, name))
    gpus = {str(i): _by_time(cols)[-MAX_SAMPLES:] for i, cols in sorted(series.items())}
    return {
        "fields": list(CHART_FIELDS),
        "gpus": {i: [list(c) for c in zip(*rows, strict=True)] for i, rows in gpus.items()},
    }


def _by_time(columns: list[list[float | None]]) -> list[tuple[float | None, ...]]:
    """Rows in time order (the stream holds them in arrival order; a chart needs time)."""
    return sorted(zip(*columns, strict=True), key=lambda row: row[0] or 0.0)
