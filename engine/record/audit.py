"""The audit trail: every match, decision, intent, run and dead letter, on one stream."""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from engine.bus.conn import AUDIT
from engine.models import AuditRecord, subject_token

log = logging.getLogger(__name__)


def audit_subject(node: str) -> str:
    """`gpuops.audit.<node>`, or `gpuops.audit._fleet` for records about no node."""
    return f"gpuops.audit.{subject_token(node) if node else '_fleet'}"


class Auditor:
    """Writes audit records to JetStream (awaiting the store's ack) and counts them."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self.counts: Counter[str] = Counter()
        self.listeners: list[Callable[[AuditRecord], None]] = []

    async def write(self, record: AuditRecord) -> None:
        """Store one record; the caller acks its input only after this returns."""
        self.counts[record.type] += 1
        await self.js.publish(audit_subject(record.node), record.model_dump_json().encode())
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
    subject = audit_subject(node) if node else "gpuops.audit.>"
    try:
        info = await js.stream_info(AUDIT)
    except NotFoundError:
        return
    if info.state.messages == 0:
        return
    config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL, inactive_threshold=30.0)
    sub = await js.pull_subscribe(subject, stream=AUDIT, config=config)
    try:
        while True:
            try:
                msgs = await sub.fetch(batch, timeout=0.5)
            except (NatsTimeout, TimeoutError):
                return
            for msg in msgs:
                await msg.ack()
                try:
                    yield AuditRecord.model_validate_json(msg.data)
                except ValueError:
                    log.warning("skipping unreadable audit record at %s", msg.metadata.sequence)
            if msgs and msgs[-1].metadata.num_pending == 0:
                return
    finally:
        await sub.unsubscribe()


def as_json_line(record: AuditRecord) -> str:
    """One audit record as a JSON line for `--json` output."""
    return json.dumps(record.model_dump(mode="json"), sort_keys=True)
