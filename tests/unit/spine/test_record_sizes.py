"""Issue 31, item 2: every record built from an accepted event fits NATS's max payload.

The largest events the intake accepts (each just under MAX_EVENT_BYTES, their free text
as long as it may come) go through the shadow engine, which runs every stage the live
one runs on in-memory stores; every message it publishes (intents, audit records,
episodes) and every KV value it writes (node states, approvals, history) is measured.
"""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any

from gpuops import subjects
from gpuops.intake.decode import MAX_EVENT_BYTES, decode
from gpuops.match.loader import load_rules
from gpuops.models import MAX_ALERT_LABELS, Event, new_event
from gpuops.settings import Settings
from gpuops.spine.shadow import Shadow

from tests.conftest import ROOT

NATS_MAX_PAYLOAD = 1 << 20
T0 = 1_900_000_000.0
NODE = "node-001"


def _largest(kind: str, data: dict[str, Any], pad: str, t: float) -> Event:
    """The event with `data[pad]` grown until the payload is MAX_EVENT_BYTES."""
    doc = new_event(kind, NODE, t, {**data, pad: ""}, "agent")
    room = MAX_EVENT_BYTES - len(json.dumps(doc).encode())
    doc["data"][pad] = "\u00e9" * (room // 2)  # two bytes each: the most characters that fit
    payload = json.dumps(doc, ensure_ascii=False).encode()
    assert MAX_EVENT_BYTES - 2 <= len(payload) <= MAX_EVENT_BYTES
    return decode(payload)


def _drift(t: float) -> Event:
    # A list of floats grows when written again (9e15 is 9000000000000000.0), and this
    # rule writes `actual` and `expected` into its playbook's vars.
    values = "[" + ",".join(["9e15"] * ((MAX_EVENT_BYTES - 400) // 10)) + "]"
    data = {"setting": "mig_layout", "expected": "E", "actual": "A"}
    text = json.dumps(new_event("drift", NODE, t, data, "drift-check"))
    payload = text.replace('"E"', values).replace('"A"', values).encode()
    assert MAX_EVENT_BYTES - 400 <= len(payload) <= MAX_EVENT_BYTES
    return decode(payload)


def _alert(t: float) -> Event:
    # Every label and annotation at its bound, each value twice its bound (cut).
    filler = {f"k{i:03d}": "v" * 1500 for i in range(MAX_ALERT_LABELS - 2)}
    data = {
        "name": "GpuXidError",
        "status": "firing",
        "fingerprint": "f00d",
        "gpu": 2,
        "labels": {"xid": "62", "gpu": "2", **filler},
        "annotations": filler,
    }
    payload = json.dumps(new_event("alert", NODE, t, data, "alertmanager")).encode()
    assert len(payload) <= MAX_EVENT_BYTES
    return decode(payload)


async def test_the_largest_accepted_events_yield_records_under_the_max_payload() -> None:
    settings = Settings.model_validate(
        {"rules_dir": ROOT / "rules", "playbooks_dir": ROOT / "playbooks"}
    )
    shadow = Shadow(load_rules([settings.rules_dir], settings.playbooks_dir), [NODE], settings)
    events = [
        _largest("xid", {"gpu": 1, "xid": 62}, "message", T0),  # xid-reset-class
        _drift(T0 + 10),  # drift-mig-layout: held for approval
        _alert(T0 + 20),  # alert-xid-reset-class
        _largest("xid", {"gpu": 3, "xid": 13}, "message", T0 + 30),
        _largest("unreachable", {"check": "ssh"}, "error", T0 + 40),
    ]
    decided = [d for event in events for d in await shadow.feed(event)]
    published = shadow.publisher.messages
    rules = {d.match.rule for d in decided}
    assert {"xid-reset-class", "drift-mig-layout", "alert-xid-reset-class"} <= rules
    assert any(subjects.is_action(s) for s, _ in published), "intents were made"
    sizes = {s: len(p) for s, p in published}
    sizes |= await _kv_sizes(shadow)
    largest = max(sizes, key=sizes.__getitem__)
    assert sizes[largest] < NATS_MAX_PAYLOAD // 2, (largest, sizes[largest])


async def _kv_sizes(shadow: Shadow) -> dict[str, int]:
    """Every value the engine wrote to its buckets, by bucket and key."""
    buckets = shadow.engine.buckets
    out: dict[str, int] = {}
    for f in fields(buckets):
        kv = getattr(buckets, f.name)
        for key in await kv.keys():
            entry = await kv.get(key)
            if entry is not None:
                out[f"kv:{f.name}:{key}"] = len(entry.value)
    return out
