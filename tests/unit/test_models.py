"""Event format v1: decoding, validation, dead-letter reasons."""

from __future__ import annotations

import json

import pytest

from engine.errors import EventError
from engine.intake.decode import dead_letter, decode, event_subject
from engine.models import event_json_schema

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
