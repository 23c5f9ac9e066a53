"""What the console's pages show, read from the streams: a node's timeline from the audit
trail and its recent telemetry, each bounded (a window of time and a count).

The audit stream is written by every engine and executor version a site ever ran, and by
whoever holds the credentials: a record is read field by field, and one that does not
read is a line of its own ("unreadable", "partial"), never the page's failure."""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any, NamedTuple, TypeGuard

from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from pydantic import ValidationError

from gpuops import subjects
from gpuops.act.evidence import RUN_ID
from gpuops.bus.conn import AUDIT, TELEMETRY
from gpuops.bus.reader import one_read
from gpuops.clock import rfc3339
from gpuops.models import EVENT_ADAPTER, AuditRecord, RunOutcome, TelemetryEvent
from gpuops.record.nodestate import gpu_names

log = logging.getLogger(__name__)

MAX_TIMELINE = 300  # the newest records of a node's window
MAX_SAMPLES = 360  # per GPU chart: the telemetry stream keeps ten minutes anyway
CHART_FIELDS = ("temp_c", "power_w", "util_gpu", "dram_bw_util")
# Built-in rules (gpuops/match/builtin.py) whose decisions are a node's validation.
VALIDATION_RULES = frozenset({"validation-passed", "validation-failed"})
GRADE_CHECKS_SHOWN = 40  # a grade 3 of 8 GPUs has ~80: the first, failing ones lead
FACTS_SHOWN = 6
# Facts that name a GPU rather than say what was wrong with it: not worth a timeline's room.
FACTS_NOT_SHOWN = frozenset({"index", "uuid", "name", "labels", "node"})
# What an anonymous viewer sees of a failed run: that it failed (its outcome), not why.
LOGIN_TO_SEE = "log in to see the details of this run (which task failed, and why)"
MAX_WARNED = 1024


class Stored(NamedTuple):
    """A message's payload and when the stream stored it (epoch s)."""

    data: bytes
    at: float


class Warned:
    """Records already logged, so a bad one in view is logged once, not on every page."""

    def __init__(self, limit: int = MAX_WARNED) -> None:
        self.limit = limit
        self._seen: OrderedDict[str, None] = OrderedDict()

    def first(self, data: bytes) -> bool:
        """Whether `data` is new here (and now remembered)."""
        key = hashlib.sha256(data).hexdigest()
        if key in self._seen:
            return False
        self._seen[key] = None
        if len(self._seen) > self.limit:
            self._seen.popitem(last=False)
        return True


async def read_since(
    js: JetStreamContext, stream: str, subject: str, since: float, limit: int
) -> AsyncIterator[bytes]:
    """Payloads on `subject` stored after `since` (epoch s), oldest first, at most `limit`."""
    # Closed, this reader closes the inner one at once: its consumer goes with it.
    async with contextlib.aclosing(read_stored(js, stream, subject, since, limit)) as stored:
        async for message in stored:
            yield message.data


async def read_stored(
    js: JetStreamContext, stream: str, subject: str, since: float, limit: int
) -> AsyncGenerator[Stored, None]:
    """`read_since`, with the time the stream stored each message."""
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
                    yield Stored(msg.data, msg.metadata.timestamp.timestamp())
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
    gpus: tuple[int, ...] = ()  # the GPUs a decision was about (none: the node)
    reason: str = ""  # a decision's reason (a drop's stage)
    count: int = 1  # the drops this line stands for, from the first to the last
    # Drops the recorder did not write one by one before this record (one per period).
    repeats: int = 0
    last_at: float | None = None  # the newest of them, where there are several

    @property
    def when(self) -> str:
        """UTC time to the second ("?" for a time no calendar has)."""
        return _when(self.at)

    @property
    def last_when(self) -> str:
        """UTC time of the newest drop this line stands for."""
        return _when(self.at if self.last_at is None else self.last_at)

    @property
    def where(self) -> str:
        """The GPUs the line is about, as people name them ("GPU 3", "GPUs 1,4")."""
        return gpu_names(self.gpus)

    def for_anonymous(self) -> Entry:
        """This entry as someone not logged in sees it: a run's failure without its text."""
        if self.kind == "run" and self.detail:
            return replace(self, detail=LOGIN_TO_SEE)
        return self


def folded(last: Entry, new: Entry) -> Entry | None:
    """`last` and `new` as one line when both are the same drop (rule, reason, GPUs), so a
    rule held true under a cooldown is one line with a count, not a page of them."""
    if not (last.kind == new.kind == "drop"):
        return None
    if (last.rule, last.reason, last.gpus) != (new.rule, new.reason, new.gpus):
        return None
    # The drops the recorder left out before `new` fell between the two: they count.
    count = last.count + new.repeats + new.count
    return replace(last, count=count, last_at=new.last_at or new.at)


def _when(at: float) -> str:
    try:
        return rfc3339(at)[:19].replace("T", " ")
    except (ValueError, OverflowError, OSError):
        return "?"


def unreadable(at: float, why: str) -> Entry:
    """The line of a record that could not be read at all."""
    return Entry(at, "note", "", "unreadable audit record", why)


def _mapping(body: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = body.get(key)
    return value if isinstance(value, Mapping) else {}


def _text(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    return value if isinstance(value, str) else None


def entry(record: AuditRecord) -> Entry:
    """A timeline entry for one audit record."""
    if record.type == "run":
        return _run_entry(record)
    if record.type != "decision":
        return Entry(record.at, "note", record.rule, record.summary)
    d = _mapping(record.body, "decision")
    reason, detail = _text(d, "reason") or "", _text(d, "detail") or ""
    shown = _mapping(record.body, "facts").items()
    said = (kv for kv in shown if isinstance(kv[0], str) and kv[0] not in FACTS_NOT_SHOWN)
    facts = dict(list(said)[:FACTS_SHOWN])
    if record.rule in VALIDATION_RULES:
        kind = "validation"
    elif d.get("accepted") or reason in ("approval_pending", "no_action", "needs_human"):
        kind = "fault"
    else:
        kind = "drop"
    why = f"{reason}: {detail}" if detail else reason
    gpus = _gpus(_mapping(d, "match"), _mapping(record.body, "facts"))
    repeats = record.body.get("repeats_suppressed")
    return Entry(
        record.at,
        kind,
        record.rule,
        record.summary,
        why,
        facts,
        gpus=gpus,
        reason=reason,
        repeats=repeats if _is_index(repeats) else 0,
    )


def _gpus(match: Mapping[str, Any], facts: Mapping[str, Any]) -> tuple[int, ...]:
    """The GPUs of a decision: its match's (several for a per-node rule), else its one
    GPU, else the fact's index (a record written before matches carried them)."""
    found = match.get("gpus")
    if isinstance(found, list) and found and all(_is_index(g) for g in found):
        return tuple(sorted(set(found)))
    for one in (match.get("gpu"), facts.get("index")):
        if _is_index(one):
            return (one,)
    return ()


def _is_index(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _run_entry(record: AuditRecord) -> Entry:
    try:
        o = RunOutcome.model_validate(record.body)
    except ValidationError:
        return _partial_run(record)
    failed = f"task {o.failed_task!r}: {o.failed_message or '-'}" if o.failed_task else ""
    # A grade's verdict and its numbers are what the run was for: shown with the run.
    graded = f"; {o.grade.summary()}" if o.grade else ""
    shown = sorted(o.grade.checks, key=lambda c: c.ok)[:GRADE_CHECKS_SHOWN] if o.grade else []
    checks = "; ".join(("FAIL " if not c.ok else "") + c.describe() for c in shown)
    return Entry(
        record.at,
        "run",
        record.rule,
        # Built from the fields, not the summary: the summary carries the run's error text,
        # which (like the failed task) only a logged-in viewer sees, in `detail`.
        f"{o.playbook} {o.status.value} rc={o.rc} in {o.duration_s:.1f}s{graded}",
        "; ".join(part for part in (failed, o.error or "", checks) if part),
        run_id=_run_id(o.run_id),
        revision=o.revision,
        outcome=o.status.value,
    )


def _partial_run(record: AuditRecord) -> Entry:
    """A run record whose body is not a whole outcome: what of it reads."""
    b = record.body
    task, message = _text(b, "failed_task"), _text(b, "failed_message")
    return Entry(
        record.at,
        "run",
        record.rule,
        f"{_text(b, 'playbook') or 'a playbook'} run (partial record)",
        f"task {task!r}: {message or '-'}" if task else record.summary,
        run_id=_run_id(_text(b, "run_id")),
        revision=_text(b, "revision"),
        outcome=_text(b, "status"),
    )


def _run_id(value: str | None) -> str | None:
    return value if value and RUN_ID.match(value) else None


def is_run(body: Mapping[str, Any]) -> bool:
    """Whether a run record's body is the whole outcome an executor writes."""
    try:
        RunOutcome.model_validate(body)
    except ValidationError:
        return False
    return True


def _read(stored: Stored, node: str, warned: Warned) -> Entry:
    """The entry of one stored record: partial where its body is off, unreadable where
    even its envelope is (each logged the first time it is in view)."""
    try:
        record = AuditRecord.model_validate_json(stored.data)
    except ValueError as exc:
        if warned.first(stored.data):
            log.warning("unreadable audit record of %s: %s", node, str(exc)[:300])
        return unreadable(stored.at, "not an audit record of this version")
    if record.type == "run" and not is_run(record.body) and warned.first(stored.data):
        log.warning("partial run record of %s at %s shown as far as it reads", node, record.at)
    try:
        return entry(record)
    except (TypeError, KeyError, AttributeError) as exc:  # a shape no reader above foresaw
        if warned.first(stored.data):
            log.warning("unreadable audit record of %s: %r", node, exc)
        return unreadable(stored.at, f"a {record.type} record that does not read")


async def timeline(
    js: JetStreamContext, node: str, since: float, warned: Warned | None = None
) -> list[Entry]:
    """The node's audit records after `since` as entries, oldest first (the newest few
    hundred lines), the same drop in a row folded into one line."""
    warned = warned or Warned()
    newest: deque[Entry] = deque(maxlen=MAX_TIMELINE)
    async for stored in read_stored(js, AUDIT, subjects.audit(node), since, 100_000):
        line = _read(stored, node, warned)
        both = folded(newest[-1], line) if newest else None
        if both is None:
            newest.append(line)
        else:
            newest[-1] = both
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
