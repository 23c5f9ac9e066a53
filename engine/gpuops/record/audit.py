"""The audit trail: every match, decision, intent, run and dead letter, on one stream."""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import Error as JsError
from nats.js.errors import NotFoundError, ServiceUnavailableError

from gpuops import subjects
from gpuops.bus.conn import AUDIT
from gpuops.bus.publish import Publisher
from gpuops.bus.reader import one_read
from gpuops.errors import BusError
from gpuops.models import AuditRecord

log = logging.getLogger(__name__)


def audit_subject(node: str) -> str:
    """`gpuops.audit.<node>`, or `gpuops.audit._fleet` for records about no node."""
    return subjects.audit(node)


# A record is small: one decision or run. Oversized fields (a 1 MiB XID message) are cut
# and their hash kept, so the trail stays under NATS's max payload and still proves
# what the original was.
MAX_FIELD_CHARS = 4096
READ_STALLS = 20  # fetches in a row that bring nothing while records are still pending
MAX_LIST_ITEMS = 200
MAX_RECORD_BYTES = 256 * 1024


def _bounded(value: Any, cut: dict[str, str], path: str) -> Any:
    if isinstance(value, str) and len(value) > MAX_FIELD_CHARS:
        cut[path] = hashlib.sha256(value.encode()).hexdigest()
        return value[:MAX_FIELD_CHARS] + f"... [{len(value)} chars]"
    if isinstance(value, dict):
        return {k: _bounded(v, cut, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, list | tuple):
        items = [_bounded(v, cut, f"{path}[{i}]") for i, v in enumerate(value[:MAX_LIST_ITEMS])]
        if len(value) > MAX_LIST_ITEMS:
            cut[path] = f"{len(value)} items"
        return items
    return value


def bounded(record: AuditRecord) -> bytes:
    """The record as JSON, with oversized fields cut (and their sha256 kept in `truncated`)."""
    data = record.model_dump_json().encode()
    if len(data) <= MAX_RECORD_BYTES and len(record.summary) <= MAX_FIELD_CHARS:
        return data
    cut: dict[str, str] = {}
    body = _bounded(record.body, cut, "body")
    summary = _bounded(record.summary, cut, "summary")
    small = record.model_copy(update={"body": {**body, "truncated": cut}, "summary": summary})
    data = small.model_dump_json().encode()
    if len(data) > MAX_RECORD_BYTES:  # deep nesting: keep only the hash of the whole body
        digest = hashlib.sha256(record.model_dump_json().encode()).hexdigest()
        small = small.model_copy(update={"body": {"truncated": {"body": digest}}})
        data = small.model_dump_json().encode()
    return data


class Auditor:
    """Writes audit records (awaiting the store's ack) and counts them."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher
        self.counts: Counter[str] = Counter()
        self.listeners: list[Callable[[AuditRecord], None]] = []  # the demo's live timeline

    async def write(self, record: AuditRecord, msg_id: str | None = None) -> None:
        """Store one record; the caller acks its input only after this returns."""
        self.counts[record.type] += 1
        stored = await self.publisher.publish(audit_subject(record.node), bounded(record), msg_id)
        if not stored:
            return  # the same record again (a replay, or the executor's copy of a decision)
        for listener in self.listeners:
            listener(record)

    async def note(
        self, at: float, node: str, summary: str, body: dict[str, Any] | None = None
    ) -> None:
        """Record something that is neither a decision nor a run."""
        await self.write(
            AuditRecord(type="note", at=at, node=node, summary=summary, body=dict(body or {}))
        )


async def read_audit(
    js: JetStreamContext, node: str | None = None, batch: int = 512
) -> AsyncIterator[AuditRecord]:
    """Every stored audit record, oldest first, optionally for one node."""
    subject = audit_subject(node) if node else subjects.AUDIT
    try:
        info = await js.stream_info(AUDIT)
    except NotFoundError:
        return
    if info.state.messages == 0:
        return
    config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    async with one_read(js, subject, AUDIT, config) as sub:
        stalls = 0
        while True:
            try:
                msgs = await sub.fetch(batch, timeout=0.5)
            except (NatsTimeout, TimeoutError, ServiceUnavailableError) as exc:
                # Nothing came: the end, or a busy server (on a cluster, a new consumer
                # answers 503 until its leader is elected). Asked, never guessed: a read
                # that stops early would show a trail with decisions missing.
                if await _read_all(sub):
                    return
                stalls += 1
                if stalls >= READ_STALLS:
                    raise BusError(f"reading the audit trail stalled ({exc!r})") from exc
                continue
            stalls = 0
            for msg in msgs:
                try:
                    yield AuditRecord.model_validate_json(msg.data)
                except ValueError:
                    log.warning("skipping unreadable audit record at %s", msg.metadata.sequence)
            if msgs and msgs[-1].metadata.num_pending == 0:
                return


async def _read_all(sub: JetStreamContext.PullSubscription) -> bool:
    """Whether the read's consumer has delivered everything its subject holds."""
    try:
        info = await sub.consumer_info()
    except (NatsError, JsError, TimeoutError):
        return False
    return not info.num_pending and not info.num_ack_pending


def as_json_line(record: AuditRecord) -> str:
    """One audit record as a JSON line for `--json` output."""
    return json.dumps(record.model_dump(mode="json"), sort_keys=True)
