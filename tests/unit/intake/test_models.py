"""Event format v1: decoding, validation, dead-letter reasons."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest
from gpuops.errors import EventError
from gpuops.intake.decode import (
    MAX_DEAD_PAYLOAD,
    MAX_DEAD_TEXT,
    MAX_EVENT_BYTES,
    dead_letter,
    decode,
    event_subject,
)
from gpuops.models import MAX_ALERT_TEXT, MAX_TEXT, cut_text, event_json_schema

XID = {
    "id": "e1",
    "kind": "xid",
    "node": "node-001",
    "ts": "2026-11-30T01:00:00+01:00",
    "source": "agent",
    "data": {"gpu": 1, "xid": 79, "message": "fallen off the bus"},
}


def test_valid_event_decodes_with_utc_time() -> None:
    event = decode(json.dumps(XID).encode())
    assert event.kind == "xid"
    assert event.ts.isoformat() == "2026-11-30T00:00:00+00:00"
    assert event_subject(event) == "gpuops.events.xid.node-001"


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"{not json", "json"),
        (json.dumps({**XID, "kind": "weather"}).encode(), "unknown_kind"),
        (json.dumps({**XID, "ts": "2026-11-30T01:00:00"}).encode(), "schema"),  # no zone
        (json.dumps({**XID, "data": {"gpu": -1, "xid": 79}}).encode(), "schema"),
        (json.dumps({**XID, "node": "bad node!"}).encode(), "schema"),
        (json.dumps({**XID, "surprise": 1}).encode(), "schema"),
        (b"x" * (2 << 20), "too_large"),
    ],
)
def test_bad_events_name_their_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(EventError) as caught:
        decode(payload)
    assert caught.value.reason == reason


def test_subject_must_match_payload() -> None:
    with pytest.raises(EventError) as caught:
        decode(json.dumps(XID).encode(), "gpuops.events.xid.node-002")
    assert caught.value.reason == "subject_mismatch"


def test_probe_ok_must_agree_with_outcome() -> None:
    bad = {**XID, "kind": "probe", "data": {"gpu": 0, "ok": True, "outcome": "fail"}}
    with pytest.raises(EventError):
        decode(json.dumps(bad).encode())


def test_data_may_gain_fields_without_breaking() -> None:
    newer = {**XID, "data": {**XID["data"], "added_in_v1_1": True}}
    assert decode(json.dumps(newer).encode()).kind == "xid"


def test_dead_letter_keeps_the_raw_payload() -> None:
    body = json.loads(dead_letter("json", "bad", b"\xff\x00", "gpuops.events.x.y", 1.0))
    assert body["reason"] == "json" and body["payload_b64"] == "/wA="
    body = json.loads(dead_letter("json", "bad", b"{oops", "s", 1.0))
    assert body["payload"] == "{oops"


def test_schema_lists_every_kind() -> None:
    schema = json.dumps(event_json_schema())
    for kind in ("telemetry", "xid", "probe", "heartbeat", "drift", "chatops"):
        assert f'"{kind}"' in schema


def _telemetry(temp: str) -> bytes:
    event = {**XID, "kind": "telemetry", "data": {"gpus": [{"index": 0, "temp_c": 1}]}}
    return json.dumps(event).replace('"temp_c": 1', f'"temp_c": {temp}').encode()


@pytest.mark.parametrize(
    "temp", ["NaN", "Infinity", "-Infinity", "1e400", "1" + "0" * 400, "1e300"]
)
def test_numbers_that_are_not_finite_or_sane_are_schema_dead_letters(temp: str) -> None:
    assert decode(_telemetry("88.5")).kind == "telemetry"  # the same event with a real reading
    with pytest.raises(EventError) as caught:
        decode(_telemetry(temp))
    assert caught.value.reason == "schema"


@pytest.mark.parametrize(
    "data",
    ['{"gpu": 0, "xid": 1' + "0" * 400 + "}", '{"setting": "x", "expected": [1, NaN]}'],
)
def test_integers_beyond_64_bits_and_nan_in_any_field_are_refused(data: str) -> None:
    kind = "xid" if "xid" in data else "drift"
    payload = json.dumps({**XID, "kind": kind, "data": {}}).replace('"data": {}', f'"data": {data}')
    with pytest.raises(EventError) as caught:
        decode(payload.encode())
    assert caught.value.reason == "schema"


def test_event_from_the_future_is_refused_beyond_the_skew() -> None:
    payload = json.dumps(XID).encode()
    t = decode(payload).epoch
    assert decode(payload, now=t - 299.0, max_future_s=300.0).epoch == t
    with pytest.raises(EventError) as caught:
        decode(payload, now=t - 301.0, max_future_s=300.0)
    assert caught.value.reason == "future"
    assert decode(payload).epoch == t, "without the clock there is nothing to compare with"


@pytest.mark.parametrize(
    "subject",
    [
        "gpuops.events.xid.node-001.x",  # an extra token used to skip the check
        "gpuops.events.xid.node-001.node-002",
        "gpuops.events.xid",
        "gpuops.telemetry.node-001.x",
        "other.events.xid.node-001",
    ],
)
def test_subject_that_is_not_exactly_an_intake_subject_is_a_mismatch(subject: str) -> None:
    with pytest.raises(EventError) as caught:
        decode(json.dumps(XID).encode(), subject)
    assert caught.value.reason == "subject_mismatch"
    assert decode(json.dumps(XID).encode(), "gpuops.events.xid.node-001").node == "node-001"


@pytest.mark.parametrize(
    ("what", "payload"),
    [
        ("800 KB of binary", bytes(range(256)) * 3200),
        ("200 KB of control characters", b"\x01" * 200_000),
        (
            "a valid XID 1 MiB - 300 B long",
            json.dumps({**XID, "pad": "x" * (1048576 - 600)})[: 1048576 - 300].encode(),
        ),
    ],
)
def test_a_dead_letter_of_any_payload_fits_a_nats_message_and_keeps_its_length_and_hash(
    what: str, payload: bytes
) -> None:
    record = dead_letter("schema", "e" * 10_000, payload, "gpuops.events.xid." + "n" * 5000, 1.0)
    body = json.loads(record)
    assert len(record) < 256 * 1024, what  # well under NATS's 1 MiB max payload
    assert body["payload_cut"] is True and body["payload_bytes"] == len(payload)
    assert body["payload_sha256"] == hashlib.sha256(payload).hexdigest()
    kept = body.get("payload", "").encode() or base64.b64decode(body.get("payload_b64", ""))
    assert payload.startswith(kept) and len(kept) == MAX_DEAD_PAYLOAD
    assert len(body["error"]) == MAX_DEAD_TEXT and len(body["subject"]) == MAX_DEAD_TEXT


def test_a_small_dead_letter_is_kept_whole_without_a_cut_marker() -> None:
    body = json.loads(dead_letter("json", "bad", b"{oops", "s", 1.0))
    assert "payload_cut" not in body and body["payload"] == "{oops"


# --- issue 31, item 2: size is checked where it is made --------------------------------


@pytest.mark.parametrize("size", [4097, 10_000, 1_000_000])
def test_cut_text_keeps_the_bound_marks_what_it_cut_and_cuts_nothing_twice(size: int) -> None:
    text = "a" * size
    cut = cut_text(text, MAX_TEXT)
    kept = cut.index("…")
    digest = hashlib.sha256(text.encode()).hexdigest()
    assert len(cut) <= MAX_TEXT
    assert cut == "a" * kept + f"…[cut {size - kept} chars, sha256 {digest}]"
    assert cut_text(cut, MAX_TEXT) == cut  # a record read back and decoded again is the same
    assert cut_text("a" * MAX_TEXT, MAX_TEXT) == "a" * MAX_TEXT  # at the bound: kept whole


def _event(kind: str, data: dict[str, object]) -> bytes:
    return json.dumps({**XID, "kind": kind, "data": data}, ensure_ascii=False).encode()


LONG = "\u00e9" * 25_000  # two bytes each: the bound counts characters
FREE_TEXT = [
    ("xid", {"gpu": 0, "xid": 13, "message": LONG}, lambda d: [d.message]),
    ("sxid", {"sxid": 12, "message": LONG}, lambda d: [d.message]),
    ("gpu_lost", {"gpu": 0, "error": LONG}, lambda d: [d.error]),
    ("probe", {"ok": False, "outcome": "fail", "error": LONG}, lambda d: [d.error]),
    ("heartbeat", {"agent_version": LONG}, lambda d: [d.agent_version]),
    ("unreachable", {"error": LONG, "check": LONG}, lambda d: [d.error, d.check]),
    ("drift", {"setting": LONG, "expected": LONG, "actual": [LONG]}, lambda d: [d.setting]),
    (
        "chatops",
        {"command": "drain", "args": [LONG], "user": LONG, "reason": LONG, "channel": LONG},
        lambda d: [d.args[0], d.user, d.reason, d.channel],
    ),
    (
        "alert",
        {"name": "GpuXid", "status": "firing", "fingerprint": "f1"}
        | {"labels": {"xid": LONG}, "annotations": {"summary": LONG}},
        lambda d: [d.labels["xid"], d.annotations["summary"]],
    ),
]


@pytest.mark.parametrize(("kind", "data", "texts"), FREE_TEXT, ids=[f[0] for f in FREE_TEXT])
def test_free_text_over_its_bound_is_cut_with_a_marker_and_the_event_decided(
    kind: str, data: dict[str, object], texts: object
) -> None:
    event = decode(_event(kind, data))  # under MAX_EVENT_BYTES: accepted, not refused
    cut = texts(event.data)  # type: ignore[operator]
    bound = MAX_ALERT_TEXT if kind in ("alert", "sxid") else MAX_TEXT
    for text in cut:
        assert len(text) <= bound and text.startswith("\u00e9" * 100), kind
        digest = hashlib.sha256(LONG.encode()).hexdigest()
        assert text.endswith(f"…[cut {25_000 - text.index('…')} chars, sha256 {digest}]"), kind
    assert len(event.model_dump_json()) < 64 * 1024, "the accepted event is small"


def test_an_any_value_longer_than_the_bound_is_kept_as_its_json_cut() -> None:
    event = decode(_event("drift", {"setting": "mig_layout", "actual": [9e15] * 5000}))
    actual = event.data.actual  # type: ignore[union-attr]
    assert isinstance(actual, str) and actual.startswith("[9000000000000000.0, ")
    assert len(actual) <= MAX_TEXT and "…[cut " in actual


def test_an_event_over_max_event_bytes_is_too_large_and_one_at_it_is_read() -> None:
    head = _event("xid", {"gpu": 0, "xid": 13, "message": ""})
    pad = MAX_EVENT_BYTES - len(head)
    at_limit = _event("xid", {"gpu": 0, "xid": 13, "message": "m" * pad})
    assert len(at_limit) == MAX_EVENT_BYTES
    message = decode(at_limit).data.message  # type: ignore[union-attr]
    digest = hashlib.sha256(b"m" * pad).hexdigest()
    assert message.endswith(f"…[cut {pad - message.index('…')} chars, sha256 {digest}]")
    over = _event("xid", {"gpu": 0, "xid": 13, "message": "m" * (pad + 1)})
    with pytest.raises(EventError) as caught:
        decode(over)
    assert caught.value.reason == "too_large"
    assert caught.value.message == f"{MAX_EVENT_BYTES + 1} bytes > {MAX_EVENT_BYTES}"
