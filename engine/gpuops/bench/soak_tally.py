"""Counting for the soak (gpuops.bench.soak): what the streams, the audit trail and the simulated
nodes' tool calls say once the run is over, and the invariants over those counts.

Everything here reads through a NATS client or the fleet's files; nothing reaches into a
running engine.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from gpuops import subjects
from gpuops.bus.conn import ACTIONS, AUDIT, DLQ, EVENTS, TELEMETRY
from gpuops.models import AuditRecord
from gpuops.record.audit import read_audit
from gpuops.scale.lag import lags, partition_count

# The consumers that must have nothing pending at the end, per stream: the engine's are
# one per partition, counted together under these names (`engine_state`).
CONSUMERS: tuple[tuple[str, str], ...] = (
    (EVENTS, "gpuops-engine"),
    (TELEMETRY, "gpuops-engine-telemetry"),
    (ACTIONS, "gpuops-executor"),
)
ENGINE_CONSUMERS = {"gpuops-engine": False, "gpuops-engine-telemetry": True}  # -> telemetry?

# Playbook -> (tool, argument that marks the remediating call). A second such call for
# one intent on one node is a remediation run twice; the playbooks' own markers and the
# executor's claims are both meant to prevent it.
REMEDIATION_CALLS: dict[str, tuple[str, str]] = {
    "gpu_reset.yml": ("nvidia-smi", "-r"),
    "reboot.yml": ("reboot", ""),
    "reprovision.yml": ("ipmitool", "off"),  # its cold cycle: power off, hold, power on
}


@dataclass
class AuditTally:
    """The audit trail reduced to what the invariants need."""

    records: int = 0
    decisions: int = 0
    accepted: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    decided_intents: set[str] = field(default_factory=set)  # intents of accepted decisions
    followup_intents: set[str] = field(default_factory=set)  # written after a passing probe
    runs: Counter[str] = field(default_factory=Counter)  # run records per intent key
    run_status: Counter[str] = field(default_factory=Counter)
    started: dict[str, tuple[str, str]] = field(default_factory=dict)  # intent -> node, book
    not_run_again: dict[str, str] = field(default_factory=dict)  # intent -> claim state

    def add(self, r: AuditRecord) -> None:
        """Fold one record in."""
        self.records += 1
        if r.type == "decision":
            self._decision(r)
        elif r.type == "run":
            key = str(r.body.get("intent_key", ""))
            self.runs[key] += 1
            self.run_status[str(r.body.get("status", "?"))] += 1
            self.started.setdefault(key, (r.node, str(r.body.get("playbook", ""))))
        elif r.type == "note":
            self._note(r)

    def _decision(self, r: AuditRecord) -> None:
        self.decisions += 1
        decision = r.body.get("decision") or {}
        self.reasons[str(decision.get("reason", "?"))] += 1
        if decision.get("accepted"):
            self.accepted += 1
            self.decided_intents.update(str(k) for k in r.body.get("intents") or [])

    def _note(self, r: AuditRecord) -> None:
        intent = r.body.get("intent")
        if not isinstance(intent, str):
            return
        if r.summary.startswith("probe passed"):
            self.followup_intents.add(intent)
        elif r.summary.startswith("running "):
            # "running PLAYBOOK on NODE", written just before ansible starts
            self.started[intent] = (r.node, r.summary.split()[1])
        elif "not run again" in r.summary:
            self.not_run_again[intent] = str(r.body.get("claim", "?"))


@dataclass
class StreamCounts:
    """Stream and consumer state at the end."""

    messages: dict[str, int] = field(default_factory=dict)
    last_seq: dict[str, int] = field(default_factory=dict)
    consumers: dict[str, dict[str, int]] = field(default_factory=dict)
    dlq_from: Counter[str] = field(default_factory=Counter)  # dead letters per source stream
    queued_intents: set[str] = field(default_factory=set)  # intents still in the work queue


async def consumer_state(js: JetStreamContext, stream: str, durable: str) -> dict[str, int]:
    """Pending, ack-pending, ack floor and redeliveries of one durable consumer; for the
    engine's, every partition's together, with `ack_floor` the number of messages acked."""
    if durable in ENGINE_CONSUMERS:
        return await engine_state(js, ENGINE_CONSUMERS[durable])
    try:
        info = await js.consumer_info(stream, durable)
    except NotFoundError:
        return {"missing": 1}
    floor = info.ack_floor.stream_seq if info.ack_floor else 0
    delivered = info.delivered.stream_seq if info.delivered else 0
    return {
        "pending": int(info.num_pending or 0),
        "ack_pending": int(info.num_ack_pending or 0),
        "redelivered": int(info.num_redelivered or 0),
        "ack_floor": int(floor or 0),
        "delivered": int(delivered or 0),
    }


async def engine_state(js: JetStreamContext, telemetry: bool) -> dict[str, int]:
    """The engine's consumers of one stream, all partitions together."""
    parts = await lags(js, telemetry, await partition_count(js))
    return {
        "pending": sum(p.pending for p in parts),
        "ack_pending": sum(p.ack_pending for p in parts),
        "ack_floor": sum(max(0, p.messages - p.pending - p.ack_pending) for p in parts),
        "delivered": sum(p.messages - p.pending for p in parts),
        "missing": int(any(not p.exists and p.messages for p in parts)),
    }


async def stream_counts(js: JetStreamContext) -> StreamCounts:
    """Message counts of every stream, the consumers' state, dead letters by origin."""
    counts = StreamCounts()
    for name in (TELEMETRY, EVENTS, ACTIONS, AUDIT, DLQ):
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            continue
        counts.messages[name] = int(info.state.messages)
        counts.last_seq[name] = int(info.state.last_seq)
    for stream, durable in CONSUMERS:
        counts.consumers[durable] = await consumer_state(js, stream, durable)
    for body in await _bodies(js, DLQ):
        origin = str(body.get("subject", ""))
        counts.dlq_from["events" if subjects.is_event(origin) else "other"] += 1
    counts.queued_intents = {str(b.get("key")) for b in await _bodies(js, ACTIONS)}
    return counts


async def _bodies(js: JetStreamContext, stream: str) -> list[dict[str, Any]]:
    """Every stored message of a (small) stream as JSON, read by sequence without a consumer."""
    info = await js.stream_info(stream)
    out: list[dict[str, Any]] = []
    if not info.state.messages:
        return out
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        try:
            msg = await js.get_msg(stream, seq)
        except NotFoundError:
            continue  # acked out of a work queue, or deleted
        try:
            body = json.loads(msg.data or b"{}")
        except ValueError:
            body = {}
        out.append(body if isinstance(body, dict) else {})
    return out


async def audit_tally(js: JetStreamContext) -> AuditTally:
    """Read the whole audit stream once."""
    tally = AuditTally()
    async for record in read_audit(js):
        tally.add(record)
    return tally


def tool_calls(node_dir: Path) -> Counter[str]:
    """Remediating tool calls on one simulated node, per playbook that makes them."""
    found: Counter[str] = Counter()
    path = node_dir / "calls.jsonl"
    if not path.exists():
        return found
    for line in path.read_text().splitlines():
        row = json.loads(line)
        for book, (tool, marker) in REMEDIATION_CALLS.items():
            if row.get("tool") == tool and (not marker or marker in row.get("argv", [])):
                found[book] += 1
    return found


def extra_tool_calls(nodes_dir: Path, tally: AuditTally) -> dict[str, int]:
    """`node/playbook` -> remediating calls beyond the intents started there (want none)."""
    started: Counter[tuple[str, str]] = Counter(tally.started.values())
    extra: dict[str, int] = {}
    for node_dir in sorted(p for p in nodes_dir.iterdir() if p.is_dir()):
        for book, calls in tool_calls(node_dir).items():
            over = calls - started[(node_dir.name, book)]
            if over > 0:
                extra[f"{node_dir.name}/{book}"] = over
    return extra


def invariants(
    counts: StreamCounts, tally: AuditTally, extra_calls: dict[str, int], given_up: int
) -> dict[str, Any]:
    """The figures and the invariants; `failed` lists the invariants that do not hold."""
    engine = counts.consumers.get("gpuops-engine", {})
    published = counts.messages.get(EVENTS, 0)
    dead = counts.dlq_from.get("events", 0)
    # Acked by the durable consumer: everything up to the ack floor, given nothing pends.
    acked = engine.get("ack_floor", 0)
    decided = acked - dead - given_up
    written = tally.decided_intents | tally.followup_intents
    seen = set(tally.runs) | set(tally.not_run_again) | set(tally.started)
    handled = seen | counts.queued_intents
    twice = sorted(k for k, n in tally.runs.items() if n > 1)
    interrupted = sorted(set(tally.started) - set(tally.runs))
    no_decision = sorted(seen - written)
    no_intent = sorted(tally.decided_intents - handled)
    checks = {
        "every health event decided or dead-lettered": published == decided + dead
        and engine.get("pending", 1) == 0
        and engine.get("ack_pending", 1) == 0,
        "no remediation run twice": not twice and not extra_calls,
        "no intent without an accepted decision": not no_decision,
        "no accepted decision without an intent": not no_intent,
        # An executor killed mid-run leaves a claim that goes stale: the run is recorded
        # as interrupted (or retried, where the catalogue says it is safe), never lost.
        "every started run has an outcome": not interrupted,
    }
    return {
        "events_published": published,
        "events_acked": acked,
        "events_decided": decided,
        "dead_lettered": dead,
        "dead_lettered_other": counts.dlq_from.get("other", 0),
        "given_up_max_deliver": given_up,
        "decision_records": tally.decisions,
        "accepted_decisions": tally.accepted,
        "decision_reasons": dict(tally.reasons),
        "intents_decided": len(tally.decided_intents),
        "intents_followup": len(tally.followup_intents),
        "runs": sum(tally.runs.values()),
        "run_status": dict(tally.run_status),
        "intents_run_twice": len(twice),
        "extra_tool_calls": extra_calls,
        "runs_interrupted": len(interrupted),
        "not_run_again": dict(Counter(tally.not_run_again.values())),
        "intents_without_accepted_decision": len(no_decision),
        "accepted_decisions_without_intent": len(no_intent),
        "intents_still_queued": len(counts.queued_intents),
        "consumers": counts.consumers,
        "stream_messages": counts.messages,
        "audit_records": tally.records,
        "examples": {
            "run_twice": twice[:5],
            "interrupted": interrupted[:5],
            "without_decision": no_decision[:5],
            "without_intent": no_intent[:5],
        },
        "checks": checks,
        "failed": [name for name, ok in checks.items() if not ok],
    }
