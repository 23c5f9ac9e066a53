"""Bytes from the bus to typed events; every failure names a dead-letter reason."""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from gpuops import subjects
from gpuops.bus import wire
from gpuops.bus.identity import Verifier
from gpuops.clock import rfc3339
from gpuops.errors import EventError
from gpuops.intake.compact import FactsBook
from gpuops.intake.fastdecode import telemetry_facts
from gpuops.match.facts import Telemetry
from gpuops.models import EVENT_ADAPTER, Event, TelemetryEvent

# An event bigger than this is a dead letter (`too_large`) before it is read. NATS takes
# up to 1 MiB, but a decision's intent carries its facts (and their copies in playbook
# vars): an event at a quarter of that, its free text cut (models.MAX_TEXT), leaves
# every record built from it under the max payload. The largest real one, a 64-GPU
# sample with its labels, is well under.
MAX_EVENT_BYTES = 256 * 1024
MAX_FUTURE_S = 300.0  # the default of settings.max_future_skew_s


def decode(
    payload: bytes,
    subject: str | None = None,
    now: float | None = None,
    max_future_s: float = MAX_FUTURE_S,
) -> Event:
    """Validate one event; raise EventError(reason) for the dead-letter subject.

    With `now` (the engine's clock), an event dated more than `max_future_s` after it
    is refused as `future`: windows run on event time, and a date in the future would
    hold its key's windows (a deadman, a cooldown) hostage until the clock caught up.
    """
    if len(payload) > MAX_EVENT_BYTES:
        raise EventError("too_large", f"{len(payload)} bytes > {MAX_EVENT_BYTES}")
    try:
        event = EVENT_ADAPTER.validate_json(payload)
    except ValidationError as exc:
        raise EventError(_reason(exc), _summary(exc)) from exc
    if subject is not None:
        _check_subject(event, subject)
    if now is not None:
        check_future(event, now, max_future_s)
    return event


def check_future(
    event: Event | Telemetry | wire.Compact, now: float, max_future_s: float = MAX_FUTURE_S
) -> None:
    """Refuse, as `future`, an event dated more than `max_future_s` after `now` (the
    intake's clock live, the recording's own time in `gpuops replay`)."""
    if event.epoch - now > max_future_s:
        raise EventError(
            "future",
            f"ts {rfc3339(event.epoch)} is {event.epoch - now:.0f} s after the engine's clock "
            f"(limit {max_future_s:.0f} s): check the sender's clock (NTP)",
        )


def decode_intake(
    payload: bytes,
    subject: str | None = None,
    now: float | None = None,
    max_future_s: float = MAX_FUTURE_S,
    *,
    headers: Mapping[str, str] | None = None,
    verifier: Verifier | None = None,
    book: FactsBook | None = None,
) -> Event | Telemetry:
    """`decode`, with telemetry straight to facts: what the intake hands the pipeline.

    A sample the fast reader is sure of (the plain JSON agents send) becomes facts
    without the model; anything else (a number as a string, a surprising timestamp, a
    broken sample) goes through `decode`, so what is refused, and why, is the model's.
    With a `verifier`, the publisher the `headers` name is proved (gpuops.bus.identity)
    before the payload is read, from the subject parsed once for both checks, and kept
    on the event for the record; whatever the payload says there is replaced. Telemetry
    v2 is joined to its node's static facts in `book` (without one it is refused).
    """
    publisher, parsed = "", None
    if verifier is not None and subject is not None:
        parsed = subjects.parse_event(subject)
        publisher = verifier.publisher(headers, payload, *parsed)
    maybe_telemetry = subject is None or subject.startswith(subjects.TELEMETRY_PREFIX)
    if maybe_telemetry and len(payload) <= MAX_EVENT_BYTES and wire.is_v2(payload):
        if book is None:
            raise EventError("schema", "telemetry v2 where only v1 is read")
        doc = book.read(payload)
        # Whose facts these are is the subject's node (its publisher proved), checked
        # before anything is looked up or learnt: no node teaches the book another's.
        if subject is not None:
            _check_parsed(doc, subject, parsed or subjects.parse_event(subject))
        if now is not None:
            check_future(doc, now, max_future_s)
        return book.join(doc, not wire.is_msgpack(payload), publisher)
    if maybe_telemetry and len(payload) <= MAX_EVENT_BYTES:
        fast = telemetry_facts(payload, publisher)
        if fast is not None:
            if subject is not None:
                _check_parsed(fast, subject, parsed or subjects.parse_event(subject))
            if now is not None and fast.epoch - now > max_future_s:
                decode(payload, subject, now, max_future_s)  # raises `future`, worded once
            return fast
    event = decode(payload, subject, now, max_future_s)
    if publisher != event.publisher:
        event = event.model_copy(update={"publisher": publisher})
    return Telemetry.of(event) if isinstance(event, TelemetryEvent) else event


def decode_line(line: bytes, book: FactsBook) -> Event | Telemetry:
    """One line of a file (a recording, events to publish), v1 or v2 as `gpuops export`
    writes them: a v2 sample joined to the static facts the lines before it carried."""
    return book.telemetry(line) if wire.is_v2(line) else decode(line)


def _reason(exc: ValidationError) -> str:
    kinds = {e["type"] for e in exc.errors()}
    if "json_invalid" in kinds or "json_type" in kinds:
        return "json"
    if kinds & {"union_tag_invalid", "union_tag_not_found"}:
        return "unknown_kind"
    return "schema"


def _summary(exc: ValidationError) -> str:
    parts = [
        f"{'.'.join(map(str, e['loc'])) or 'event'}: {e['msg']}"
        for e in exc.errors(include_url=False)[:5]
    ]
    more = exc.error_count() - len(parts)
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


def _check_subject(event: Event | Telemetry, subject: str) -> None:
    """The subject's kind and node must be the payload's: per-node publish permissions hold."""
    _check_parsed(event, subject, subjects.parse_event(subject))


def _check_parsed(
    event: Event | Telemetry | wire.Compact, subject: str, parsed: tuple[str, str]
) -> None:
    kind, node = parsed
    if kind != event.kind or node != subjects.token(event.node):
        raise EventError(
            "subject_mismatch",
            f"subject {subject} does not match kind={event.kind} node={event.node}",
        )


# A dead-letter record must fit NATS's max payload (1 MiB) whatever it was made from:
# 800 KB of binary grows by a third as base64, control characters six-fold as JSON
# escapes. The raw payload is kept up to this many bytes, with its length and SHA-256.
MAX_DEAD_PAYLOAD = 64 * 1024
MAX_DEAD_TEXT = 2000  # the error and the subject (network-given text too)


def dead_letter(
    reason: str, error: str, payload: bytes, subject: str, at: float, publisher: str = ""
) -> bytes:
    """The dead-letter record: reason, error, who claimed to send it, the raw payload (cut
    to MAX_DEAD_PAYLOAD bytes when longer, its whole length and hash kept), bounded."""
    body: dict[str, Any] = {
        "reason": reason,
        "error": error[:MAX_DEAD_TEXT],
        "subject": subject[:MAX_DEAD_TEXT],
        "at": at,
    }
    if publisher:
        body["publisher"] = publisher[:128]
    kept = payload[:MAX_DEAD_PAYLOAD]
    if len(kept) < len(payload):
        body["payload_bytes"] = len(payload)
        body["payload_sha256"] = hashlib.sha256(payload).hexdigest()
        body["payload_cut"] = True
    try:
        text = kept.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    # Text that JSON would escape past twice its size (control characters) goes as
    # base64 too: the record stays under 2 x MAX_DEAD_PAYLOAD whatever came.
    if text is not None and len(json.dumps(text)) <= 2 * MAX_DEAD_PAYLOAD:
        body["payload"] = text
    else:
        body["payload_b64"] = base64.b64encode(kept).decode("ascii")
    return json.dumps(body).encode()


def event_subject(event: Event) -> str:
    """Where a typed event is published."""
    return subjects.event(event.kind, event.node)
