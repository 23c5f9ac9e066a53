"""Telemetry straight to facts: exactly the model's validation, the model's facts.

Every payload goes through both readers: `decode` then `Telemetry.of` (the model) and
`decode_intake` (the fast path). Either both refuse with the same dead-letter reason,
or both give the same facts, node, id and time.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from gpuops.errors import EventError
from gpuops.intake.decode import decode, decode_intake
from gpuops.match.facts import GPU_FIELDS, Telemetry
from gpuops.models import MAX_ALERT_TEXT, MAX_TEXT, TelemetryEvent, new_event
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import fleet_gpus

NOW = 1_800_000_000.0
SUBJECT = "gpuops.telemetry.node-001"


def _both(payload: bytes, subject: str | None = SUBJECT, now: float | None = NOW) -> Any:
    """What the model makes of a payload and what the fast path does: equal, or fail."""
    try:
        event = decode(payload, subject, now)
    except EventError as exc:
        with pytest.raises(EventError) as fast_exc:
            decode_intake(payload, subject, now)
        assert (fast_exc.value.reason, fast_exc.value.message) == (exc.reason, exc.message)
        return exc.reason
    fast = decode_intake(payload, subject, now)
    if not isinstance(event, TelemetryEvent):
        assert fast == event
        return event.kind
    assert isinstance(fast, Telemetry)
    assert fast == Telemetry.of(event)
    for fact, gpu in zip(fast.facts, event.data.gpus, strict=True):
        assert list(fact)[: len(GPU_FIELDS)] == list(GPU_FIELDS)  # the audit's key order
        assert [type(fact[k]) for k in GPU_FIELDS] == [type(getattr(gpu, k)) for k in GPU_FIELDS]
    return "ok"


def _sample(gpus: list[dict[str, Any]], **envelope: Any) -> bytes:
    doc = new_event("telemetry", "node-001", NOW, {"gpus": gpus}, "agent")
    doc.update(envelope)
    return json.dumps(doc).encode()


def test_the_simulated_fleets_samples_decode_to_the_models_facts(tmp_path: Path) -> None:
    gpus = fleet_gpus(tmp_path, NOW)
    assert _both(_sample(gpus)) == "ok"
    fast = decode_intake(_sample(gpus), SUBJECT, NOW)
    assert isinstance(fast, Telemetry) and len(fast.facts) == 8
    assert fast.facts[3]["gpu"] == 3 and fast.facts[3]["node"] == "node-001"


def test_recorded_h200_samples_decode_to_the_models_facts() -> None:
    fixtures = Path(__file__).resolve().parents[2] / "fixtures" / "nvml"
    snapshot = json.loads((fixtures / "h200_snapshot.json").read_text())
    gpus = snapshot.get("gpus") or [snapshot]
    fields = set(GPU_FIELDS)
    sample = [
        {k: v for k, v in g.items() if k in fields} | {"index": i} for i, g in enumerate(gpus)
    ]
    assert _both(_sample(sample)) == "ok"


HOSTILE: list[tuple[str, bytes]] = [
    ("nan", _sample([{"index": 0, "temp_c": 1}]).replace(b'"temp_c": 1', b'"temp_c": NaN')),
    ("inf", _sample([{"index": 0, "temp_c": 1}]).replace(b'"temp_c": 1', b'"temp_c": Infinity')),
    ("huge", _sample([{"index": 0, "temp_c": 1}]).replace(b'"temp_c": 1', b'"temp_c": 1e400')),
    ("bigint", _sample([{"index": 0, "ecc_sbe_volatile": 2**70}])),
    ("string number", _sample([{"index": 0, "temp_c": "41.5"}])),
    ("bool number", _sample([{"index": 0, "temp_c": True}])),
    ("float int", _sample([{"index": 0, "pcie_gen": 5.0}])),
    ("wrong type", _sample([{"index": 0, "temp_c": [1]}])),
    ("too many gpus", _sample([{"index": i % 64} for i in range(65)])),
    ("no gpus", _sample([])),
    ("index out of range", _sample([{"index": 64}])),
    ("negative index", _sample([{"index": -1}])),
    ("no index", _sample([{"temp_c": 30.0}])),
    ("later field", _sample([{"index": 0, "hbm_gen": 4}])),
    ("extra envelope", _sample([{"index": 0}], extra=1)),
    ("bad node", _sample([{"index": 0}], node="node 001")),
    ("node with newline", _sample([{"index": 0}], node="node-001\n")),
    ("other node", _sample([{"index": 0}], node="node-002")),
    ("no zone", _sample([{"index": 0}], ts="2027-01-15T08:00:00")),
    ("future", _sample([{"index": 0}], ts="2099-01-01T00:00:00Z")),
    ("year one", _sample([{"index": 0}], ts="0001-01-01T00:00:00+01:00")),
    ("offset", _sample([{"index": 0}], ts="2027-01-15T08:00:00.5+05:30")),
    ("empty id", _sample([{"index": 0}], id="")),
    ("long source", _sample([{"index": 0}], source="s" * 201)),
    ("lone surrogate", _sample([{"index": 0, "name": "\ud800"}])),
    ("unicode", _sample([{"index": 0, "name": "Hopper\u00e9"}])),
    ("long pod", _sample([{"index": 0, "pod": "p" * 254}])),
    ("labels", _sample([{"index": 0, "labels": {"a": "b" * 1025}}])),  # cut, not refused
    ("long name", _sample([{"index": 0, "name": "n" * 5000, "uuid": "u" * 5000}])),  # cut
    ("not json", b'{"kind": "telemetry", '),
    (
        "other kind",
        json.dumps(new_event("xid", "node-001", NOW, {"gpu": 0, "xid": 48}, "a")).encode(),
    ),
    ("oversized", _sample([{"index": 0, "name": "x" * (1 << 20)}])),
    ("array", b"[1, 2]"),
]


@pytest.mark.parametrize(("what", "payload"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_samples_are_refused_as_the_model_refuses_them(what: str, payload: bytes) -> None:
    outcome = _both(payload)
    taken = ("offset", "unicode", "later field", "float int", "string number", "bool number")
    if what in (*taken, "labels", "long name"):
        assert outcome == "ok", what  # the model takes these, so must the fast path
    elif what == "other kind":
        assert outcome == "subject_mismatch"
    else:
        assert outcome != "ok", what


def test_the_subject_must_name_the_samples_node() -> None:
    payload = _sample([{"index": 0}])
    assert _both(payload, "gpuops.telemetry.node-002") == "subject_mismatch"
    assert _both(payload, "gpuops.telemetry.node-001.x") == "subject_mismatch"


_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**66), max_value=2**66),
    st.floats(allow_nan=False, allow_infinity=False),
    st.floats(min_value=-1e25, max_value=1e25),
    st.text(max_size=8),
    st.sampled_from(["41.5", "true", "0x10", "1e3", ""]),
)
_gpu = st.fixed_dictionaries(
    {"index": st.one_of(st.integers(min_value=-2, max_value=66), _scalar)},
    optional={name: _scalar for name in GPU_FIELDS if name not in ("index", "labels")}
    | {"labels": st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3)},
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    gpus=st.lists(_gpu, min_size=0, max_size=4),
    ts=st.sampled_from(
        [
            "2027-01-15T08:00:00Z",
            "2027-01-15T08:00:00.123456+02:00",
            "2027-01-15 08:00:00Z",
            "2027-01-15T08:00:00",
            "1800000000",
            "2027-13-01T00:00:00Z",
            "2027-01-15T08:00:00.5Z",
        ]
    ),
)
def test_any_sample_is_read_by_the_fast_path_as_the_model_reads_it(
    gpus: list[dict[str, Any]], ts: str
) -> None:
    _both(_sample(gpus, ts=ts), now=time.time())


def test_non_finite_values_never_reach_a_fact() -> None:
    fast = decode_intake(_sample([{"index": 0, "temp_c": 1.8e19, "power_w": -0.0}]), SUBJECT, NOW)
    assert isinstance(fast, Telemetry)
    assert all(math.isfinite(v) for v in (fast.facts[0]["temp_c"], fast.facts[0]["power_w"]))


def test_free_text_over_its_bound_is_cut_alike_on_both_paths_and_marked() -> None:
    payload = _sample([{"index": 0, "name": "n" * 10_000, "labels": {"pod": "p" * 2000}}])
    fast = decode_intake(payload, SUBJECT, NOW)
    assert isinstance(fast, Telemetry)
    event = decode(payload, SUBJECT, NOW)
    assert isinstance(event, TelemetryEvent) and Telemetry.of(event) == fast
    name, pod = fast.facts[0]["name"], fast.facts[0]["labels"]["pod"]
    digest = hashlib.sha256(b"n" * 10_000).hexdigest()
    assert len(name) <= MAX_TEXT
    assert name.endswith(f"…[cut {10_000 - name.index('…')} chars, sha256 {digest}]")
    assert len(pod) <= MAX_ALERT_TEXT and pod.startswith("p" * 900) and "…[cut " in pod
