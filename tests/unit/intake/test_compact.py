"""Telemetry v2: the same facts as v1 of the same sample, static facts that change reach
the rules at the next sample, a replica taking over joins from KV, and a hostile v2
sample is refused with the dead-letter reason its fault names."""

from __future__ import annotations

import json
import math
import typing
from pathlib import Path
from typing import Any

import msgspec
import pytest
from gpuops.bus import wire
from gpuops.bus.store import MemoryKV
from gpuops.errors import EventError
from gpuops.intake.compact import MISS_TTL_S, SWITCH_AFTER, FactsBook, FactsUnknown
from gpuops.intake.decode import decode_intake
from gpuops.match.facts import GPU_FIELDS, Telemetry
from gpuops.models import GpuSample
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import fleet_gpus

NOW = 1_800_000_000.0
NODE = "node-001"
SUBJECT = f"gpuops.telemetry.{NODE}"
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "nvml"


def _facts(payload: bytes, book: FactsBook) -> Telemetry:
    got = decode_intake(payload, SUBJECT, NOW, book=book)
    assert isinstance(got, Telemetry)
    return got


def _same_facts(gpus: list[dict[str, Any]], t: float = NOW) -> None:
    """v1 JSON, v2 MessagePack and v2 JSON of one sample: equal facts, key order, types."""
    v1 = _facts(wire.TelemetryWriter("agent", version=1).encode(NODE, t, gpus, "e1"), FactsBook())
    for writer in (wire.TelemetryWriter("agent"), wire.TelemetryWriter("agent", json=True)):
        book = FactsBook()
        keyframe = writer.encode(NODE, t, gpus, "e1")
        # The keyframe is read the long way (the book knows no order yet); the sample
        # after it in one parse, its arrays in the order the book has joined.
        after = writer.encode(NODE, t, gpus, "e1")
        assert writer.keyframes == 1
        for payload in (keyframe, after):
            v2 = _facts(payload, book)
            assert (v2.id, v2.node, v2.epoch, v2.source) == (v1.id, v1.node, v1.epoch, v1.source)
            assert v2.facts == v1.facts
            for a, b in zip(v2.facts, v1.facts, strict=True):
                assert list(a) == list(b), "the same keys in the same order (the audit's)"
                assert [type(a[k]) for k in a] == [type(b[k]) for k in b]
        assert not isinstance(book.read(after).gpus, msgspec.Raw), "read in one parse"


def test_the_simulated_fleets_sample_gives_the_same_facts_in_v1_and_v2(tmp_path: Path) -> None:
    _same_facts(fleet_gpus(tmp_path, NOW))


def test_a_recorded_h200_sample_gives_the_same_facts_in_v1_and_v2() -> None:
    snapshot = json.loads((FIXTURES / "h200_snapshot.json").read_text())
    gpus = snapshot.get("gpus") or [snapshot]
    fields = set(GPU_FIELDS)
    _same_facts(
        [{k: v for k, v in g.items() if k in fields} | {"index": i} for i, g in enumerate(gpus)]
    )


def _value(name: str) -> st.SearchStrategy[Any]:
    """Values the model takes as they are for one field (None: not reported)."""
    base = next(
        a for a in typing.get_args(GpuSample.model_fields[name].annotation) if a is not type(None)
    )
    base = typing.get_args(base)[0] if typing.get_origin(base) is typing.Annotated else base
    kinds: dict[Any, st.SearchStrategy[Any]] = {
        float: st.floats(-1e19, 1e19, allow_nan=False) | st.integers(-(2**53), 2**53),
        int: st.integers(-(2**63), 2**63 - 1),
        bool: st.booleans(),
        str: st.text(max_size=12),
    }
    if base in kinds:
        return st.none() | kinds[base]
    return st.none() | st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3)


_GPU = st.fixed_dictionaries(
    {}, optional={name: _value(name) for name in GPU_FIELDS if name != "index"}
)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_GPU, min_size=1, max_size=8), st.floats(NOW - 1e8, NOW))
def test_any_sample_gives_the_same_facts_in_v1_and_v2(gpus: list[dict[str, Any]], t: float) -> None:
    _same_facts([{"index": i, **g} for i, g in enumerate(gpus)], t)


def test_a_static_field_unset_then_set_then_unset_reaches_the_rules_each_time() -> None:
    writer, book = wire.TelemetryWriter("agent"), FactsBook()
    limits = [None, 700.0, None, 500.0]
    got = [
        _facts(writer.encode(NODE, NOW + i, _gpus(power_limit_w=v)), book).facts[0]["power_limit_w"]
        for i, v in enumerate(limits)
    ]
    assert got == limits and writer.keyframes == 4


def test_each_sample_has_its_own_labels() -> None:
    writer, book = wire.TelemetryWriter("prometheus"), FactsBook()
    first = _facts(writer.encode(NODE, NOW, _gpus(labels={"job": "dcgm"})), book)
    first.facts[0]["labels"]["job"] = "changed by someone"
    later = _facts(writer.encode(NODE, NOW + 1, _gpus(labels={"job": "dcgm"})), book)
    assert later.facts[0]["labels"] == {"job": "dcgm"}


def test_a_keyframe_about_another_node_teaches_the_book_nothing() -> None:
    book = FactsBook(MemoryKV("facts"))
    forged = wire.TelemetryWriter("agent").encode("node-002", NOW, _gpus(power_limit_w=1.0))
    with pytest.raises(EventError) as refused:
        decode_intake(forged, SUBJECT, NOW, book=book)  # node-001's subject, node-002's facts
    assert refused.value.reason == "subject_mismatch"
    assert book.facts_of("node-002") is None and not book.unsaved("node-002")
    assert book.learnt == 0


def test_a_refused_keyframe_is_not_learnt() -> None:
    book = FactsBook(MemoryKV("facts"))
    for bad in (_keyframe(gpus=[["41", 1.0]]), _keyframe(ts=NOW + 3600)):
        with pytest.raises(EventError):
            decode_intake(msgspec.msgpack.encode(bad), SUBJECT, NOW, book=book)
    assert book.facts_of(NODE) is None and not book.unsaved(NODE)


def test_a_later_agents_fields_are_ignored_as_v1_ignores_them() -> None:
    body = _keyframe(static_fields=["temp_c", "hbm_gen", "power_w"], gpus=[[40.0, 3, 300.0]])
    got = _facts(msgspec.msgpack.encode(body), FactsBook()).facts[0]
    assert "hbm_gen" not in got and (got["temp_c"], got["power_w"]) == (40.0, 300.0)


def test_only_the_inventorys_nodes_are_kept() -> None:
    writer, book = wire.TelemetryWriter("prometheus"), FactsBook(known={NODE}.__contains__)
    stranger = decode_intake(writer.encode("stranger", NOW, _gpus()), None, NOW, book=book)
    assert (
        isinstance(stranger, Telemetry) and stranger.node == "stranger"
    )  # the pipeline refuses it
    assert book.facts_of("stranger") is None and book.facts_of(NODE) is None
    _facts(writer.encode(NODE, NOW, _gpus()), book)
    assert book.facts_of(NODE) is not None


def _gpus(n: int = 2, **over: Any) -> list[dict[str, Any]]:
    base = {"uuid": "GPU-1", "name": "NVIDIA H200", "power_limit_w": 700.0, "mig_mode": False}
    return [{"index": i, **base, "temp_c": 40.0 + i, "power_w": 300.0, **over} for i in range(n)]


def test_static_facts_that_change_mid_stream_reach_the_rules_at_the_next_sample() -> None:
    writer, book = wire.TelemetryWriter("agent"), FactsBook()
    first = _facts(writer.encode(NODE, NOW, _gpus()), book)
    steady = writer.encode(NODE, NOW + 1, _gpus(temp_c=50.0))
    assert b"static" not in steady, "nothing static changed: the sample carries readings only"
    assert _facts(steady, book).facts[1]["temp_c"] == 50.0
    capped = _facts(writer.encode(NODE, NOW + 2, _gpus(power_limit_w=500.0, mig_mode=True)), book)
    assert first.facts[0]["power_limit_w"] == 700.0 and first.facts[0]["mig_mode"] is False
    assert [f["power_limit_w"] for f in capped.facts] == [500.0, 500.0]
    assert [f["mig_mode"] for f in capped.facts] == [True, True]
    after = _facts(writer.encode(NODE, NOW + 3, _gpus(power_limit_w=500.0, mig_mode=True)), book)
    assert after.facts[0]["power_limit_w"] == 500.0, "the new facts stay"
    assert writer.keyframes == 2 and book.learnt == 2


def test_a_writer_sends_a_keyframe_first_after_a_loss_and_every_interval() -> None:
    writer = wire.TelemetryWriter("agent", every_s=60.0)
    keyframe = [b"static" in writer.encode(NODE, NOW + t, _gpus()) for t in (0, 1, 59)]
    assert keyframe == [True, False, False]
    assert b"static" in writer.encode(NODE, NOW + 60, _gpus())
    assert b"static" in writer.encode(NODE, NOW - 3600, _gpus()), "a clock stepped back"
    writer.lost(NODE)
    assert b"static" in writer.encode(NODE, NOW + 61, _gpus())
    assert b"static" in writer.encode("node-002", NOW + 61, _gpus()), "per node"


async def test_a_replica_taking_over_joins_the_nodes_samples_to_the_facts_in_kv() -> None:
    kv = MemoryKV("facts")
    writer, first = wire.TelemetryWriter("agent"), FactsBook(kv)
    _facts(writer.encode(NODE, NOW, _gpus()), first)
    assert first.unsaved(NODE)
    await first.save(NODE)
    assert not first.unsaved(NODE) and list(kv.data) == [NODE]
    sample = writer.encode(NODE, NOW + 1, _gpus(temp_c=61.0))
    takeover = FactsBook(kv)
    with pytest.raises(FactsUnknown) as missing:
        _facts(sample, takeover)
    assert missing.value.reason == "facts_unknown" and missing.value.node == NODE
    assert await takeover.load(NODE, missing.value.facts, missing.value.at)
    assert _facts(sample, takeover).facts == _facts(sample, first).facts
    assert _facts(sample, takeover).facts[0]["power_limit_w"] == 700.0


async def test_facts_in_kv_that_are_not_the_samples_are_not_joined() -> None:
    kv = MemoryKV("facts")
    old, book = wire.TelemetryWriter("agent"), FactsBook(kv)
    _facts(old.encode(NODE, NOW, _gpus()), book)
    await book.save(NODE)
    newer = wire.TelemetryWriter("agent")
    newer.encode(NODE, NOW, _gpus(power_limit_w=400.0))  # its keyframe never arrived
    takeover = FactsBook(kv)
    with pytest.raises(FactsUnknown) as missing:
        _facts(newer.encode(NODE, NOW + 1, _gpus(power_limit_w=400.0)), takeover)
    assert not await takeover.load(NODE, missing.value.facts, NOW + 1), "KV has older facts"
    reads = []
    kv_get = kv.get

    async def counted(key: str) -> Any:
        reads.append(key)
        return await kv_get(key)

    kv.get = counted  # type: ignore[method-assign]
    assert not await takeover.load(NODE, missing.value.facts, NOW + 2)
    assert reads == [], "a miss is remembered (for MISS_TTL_S of the samples' time)"
    assert not await takeover.load(NODE, missing.value.facts, NOW + 1 + MISS_TTL_S)
    assert reads == [NODE], "then KV is asked again (the partition may have come back)"
    _facts(newer.encode(NODE, NOW + 200, _gpus(power_limit_w=400.0)), takeover)  # keyframe
    assert takeover.facts_of(NODE) is not None


async def test_facts_a_later_owner_saved_are_not_replaced_by_an_earlier_owners() -> None:
    kv = MemoryKV("facts")
    writer, old_owner, new_owner = wire.TelemetryWriter("agent"), FactsBook(kv), FactsBook(kv)
    _facts(writer.encode(NODE, NOW, _gpus()), old_owner)  # learnt, not saved yet
    _facts(writer.encode(NODE, NOW + 5, _gpus(power_limit_w=400.0)), new_owner)
    await new_owner.save(NODE)
    await old_owner.save(NODE)  # late: its lease ran out meanwhile
    kept = wire.read_kept(kv.data[NODE].value)
    assert kept.at == NOW + 5 and kept.static.gpus[0]["power_limit_w"] == 400.0


def test_a_book_holds_at_most_its_bound_of_nodes() -> None:
    writer, book = wire.TelemetryWriter("agent"), FactsBook(max_nodes=3)
    for i in range(5):
        decode_intake(writer.encode(f"n{i}", NOW, _gpus()), None, NOW, book=book)
    assert len(book) == 3 and book.facts_of("n0") is None and book.facts_of("n4") is not None


def _keyframe(**over: Any) -> dict[str, Any]:
    """A v2 sample as a dict (MessagePack-encoded by `_refused`), changed by `over`."""
    fields = ["temp_c", "power_w"]
    static = {"fields": fields, "gpus": [{"index": 0, "power_limit_w": 700.0}]}
    body: dict[str, Any] = {"v": 2, "id": "e1", "kind": "telemetry", "node": NODE, "ts": NOW}
    body |= {"source": "agent", "static": static, "gpus": [[40.0, 300.0]]}
    for key, value in over.items():
        if key.startswith("static_"):
            static[key.removeprefix("static_")] = value
        else:
            body[key] = value
    # The id the writer gives (the hash of the static facts) unless the case sets one.
    body.setdefault("facts", wire.facts_id(wire.Static(static["fields"], static["gpus"])))
    return body


HOSTILE: list[tuple[str, dict[str, Any], str]] = [
    ("nan", _keyframe(gpus=[[math.nan, 1.0]]), "schema"),
    ("infinity", _keyframe(gpus=[[math.inf, 1.0]]), "schema"),
    ("huge", _keyframe(gpus=[[1e30, 1.0]]), "schema"),
    ("string reading", _keyframe(gpus=[["41", 1.0]]), "schema"),
    ("short array", _keyframe(gpus=[[41.0]]), "schema"),
    ("long array", _keyframe(gpus=[[41.0, 1.0, 2.0]]), "schema"),
    ("more arrays than GPUs", _keyframe(gpus=[[41.0, 1.0], [42.0, 1.0]]), "schema"),
    ("too many GPUs", _keyframe(gpus=[[41.0, 1.0]] * 65), "schema"),
    ("nested static", _keyframe(static_gpus=[{"index": 0, "pod": {"a": {"b": "c"}}}]), "schema"),
    ("facts not its hash", _keyframe(facts="ab12"), "schema"),
    ("index in the arrays", _keyframe(static_fields=["index", "temp_c"]), "schema"),
    ("field twice", _keyframe(static_fields=["temp_c", "temp_c"]), "schema"),
    ("text as a reading", _keyframe(static_fields=["uuid", "temp_c"]), "schema"),
    ("static and array", _keyframe(static_gpus=[{"index": 0, "temp_c": 1.0}]), "schema"),
    ("bad static", _keyframe(static_gpus=[{"index": 0, "power_limit_w": "x"}]), "schema"),
    ("static index out of range", _keyframe(static_gpus=[{"index": 64}]), "schema"),
    ("bad node", _keyframe(node="node 001"), "schema"),
    # Python's `$` (msgspec's patterns are re) takes a final newline: the node may not.
    ("node ending in a newline", _keyframe(node="node-001\n"), "schema"),
    ("bad facts id", _keyframe(facts="not hex"), "schema"),
    ("negative time", _keyframe(ts=-1.0), "schema"),
    ("future", _keyframe(ts=NOW + 3600), "future"),
    ("other node", _keyframe(node="node-002"), "subject_mismatch"),
    ("extra key", _keyframe(extra=1), "schema"),
    ("version 3", _keyframe(v=3), "schema"),
    ("no keyframe yet", {k: v for k, v in _keyframe().items() if k != "static"}, "facts_unknown"),
]


# JSON has no NaN or infinity (msgspec writes them as null): MessagePack alone carries them.
_NOT_JSON = {"nan", "infinity"}


def _primed() -> FactsBook:
    """A book that has joined another node's sample in the HOSTILE samples' order, so
    it reads theirs in one parse first (node-001 it does not know)."""
    book = FactsBook()
    other = _keyframe(node="node-009")
    book.telemetry(msgspec.msgpack.encode(other))
    assert book._whole is wire.rows(tuple(other["static"]["fields"]))
    return book


@pytest.mark.parametrize(("what", "body", "reason"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_v2_samples_are_refused_by_reason(
    what: str, body: dict[str, Any], reason: str
) -> None:
    payloads = [msgspec.msgpack.encode(body)]
    payloads += [] if what in _NOT_JSON else [msgspec.json.encode(body)]
    for payload in payloads:
        messages = []
        for book in (FactsBook(), _primed()):  # read the long way, and tried in one parse
            with pytest.raises(EventError) as refused:
                decode_intake(payload, SUBJECT, NOW, book=book)
            assert refused.value.reason == reason, refused.value.message
            messages.append(refused.value.message)
        assert messages[0] == messages[1], "the same words either way"


def test_a_fleet_of_two_array_orders_joins_both_and_reads_the_larger_in_one_parse() -> None:
    # Agents mid-upgrade: node-001 writes temp_c then power_w, node-002 the other way.
    book = FactsBook()
    first, second = ["temp_c", "power_w"], ["power_w", "temp_c"]

    def sample(node: str, fields: list[str], t: float, keyframe: bool) -> bytes:
        body = _keyframe(node=node, static_fields=fields, ts=t)
        body["gpus"] = [[40.0, 300.0] if fields == first else [300.0, 40.0]]
        if not keyframe:
            del body["static"]
        return msgspec.json.encode(body)

    for node, fields in (("node-001", first), ("node-002", second)):
        book.telemetry(sample(node, fields, NOW, True))
    assert book._whole is wire.rows(tuple(first)), "the first joined, one other since"
    for i in range(1, SWITCH_AFTER):  # fewer than SWITCH_AFTER of another in a row
        for node, fields in (("node-001", first), ("node-001", first), ("node-002", second)):
            got = book.telemetry(sample(node, fields, NOW + i, False)).facts[0]
            assert (got["temp_c"], got["power_w"]) == (40.0, 300.0)
    assert book._whole is wire.rows(tuple(first)), "two of three samples: node-001's order"
    for i in range(SWITCH_AFTER):
        got = book.telemetry(sample("node-002", second, NOW + 10 + i, False)).facts[0]
        assert (got["temp_c"], got["power_w"]) == (40.0, 300.0)
    assert book._whole is wire.rows(tuple(second)), f"{SWITCH_AFTER} in a row: node-002's"
    doc = book.read(sample("node-001", first, NOW + 20, False))
    assert isinstance(doc.gpus, msgspec.Raw), "another order: read the long way"


# A keyframe naming the facts the book holds for its node, with a static that is not
# what that id hashes: its arrays in another order (shorter, permuted, or a later
# agent's column where a model field is held), each once the held order is read in one
# parse and once the keyframe's is.
_HELD = ["temp_c", "power_w", "util_gpu"]
_FORGED = [
    ("shorter", ["temp_c"], [[42.0]]),
    ("permuted", ["util_gpu", "temp_c", "power_w"], [[99.0, 41.0, 300.0]]),
    ("a later column", ["temp_c", "hbm_gen", "util_gpu"], [[41.0, 5, 99.0]]),
]


@pytest.mark.parametrize(("what", "fields", "rows"), _FORGED, ids=[f[0] for f in _FORGED])
@pytest.mark.parametrize("whole", ["held", "forged"])
def test_a_keyframe_of_the_held_facts_whose_static_is_another_is_refused(
    what: str, fields: list[str], rows: list[list[Any]], whole: str
) -> None:
    """Review of issue 30: such a keyframe was joined without the hash check. Read in one
    parse in its static's order and stored by the held order, it put readings in other
    fields (permuted), or escaped the intake as IndexError or TypeError (not a dead
    letter: the batch came back, again and again)."""
    held = _keyframe(static_fields=_HELD, gpus=[[41.0, 300.0, 99.0]])
    book = FactsBook()
    if whole == "forged":  # another node taught the book the forged order first
        book.telemetry(
            msgspec.msgpack.encode(_keyframe(node="node-009", static_fields=fields, gpus=rows))
        )
    _facts(msgspec.msgpack.encode(held), book)
    if whole == "held":
        assert book._whole is wire.rows(tuple(_HELD))
    forged = _keyframe(static_fields=fields, gpus=rows, facts=held["facts"], ts=NOW + 1)
    for payload in (msgspec.msgpack.encode(forged), msgspec.json.encode(forged)):
        with pytest.raises(EventError) as refused:
            decode_intake(payload, SUBJECT, NOW, book=book)
        assert refused.value.reason == "schema", refused.value.message
        assert "is not the hash of its static" in refused.value.message
    # The node's own samples are joined as before, to the facts it holds.
    after = _keyframe(static_fields=_HELD, gpus=[[43.0, 310.0, 98.0]], ts=NOW + 2)
    got = _facts(msgspec.msgpack.encode(after), book).facts[0]
    assert (got["temp_c"], got["power_w"], got["util_gpu"]) == (43.0, 310.0, 98.0)


def test_a_bad_static_field_is_named_by_its_gpu_and_field() -> None:
    """The GPUs' static fields are validated together; the refusal still says which."""
    good, bad = {"index": 0, "power_limit_w": 700.0}, {"index": 1, "power_limit_w": "x"}
    body = _keyframe(static_gpus=[good, bad], gpus=[[40.0, 300.0], [41.0, 301.0]])
    with pytest.raises(EventError) as refused:
        decode_intake(msgspec.msgpack.encode(body), SUBJECT, NOW, book=FactsBook())
    assert refused.value.reason == "schema"
    assert "static.gpus.1.power_limit_w:" in refused.value.message, refused.value.message


def test_a_static_value_nested_deep_is_refused_not_a_crash() -> None:
    """5,000 nested arrays in a keyframe (a few KB): refused by type before any recursion
    could exhaust the stack (which would kill the intake, not dead-letter the sample)."""
    body = _keyframe(static_gpus=[{"index": 0, "pod": "DEEP"}], facts="ab12")
    deep = (
        msgspec.msgpack.encode(body).replace(b"\xa4DEEP", b"\x91" * 5000 + b"\x90"),
        msgspec.json.encode(body).replace(b'"DEEP"', b"[" * 5000 + b"]" * 5000),
    )
    for payload in deep:
        with pytest.raises(EventError) as refused:
            decode_intake(payload, SUBJECT, NOW, book=FactsBook())
        assert refused.value.reason == "schema"


def test_rows_nested_deep_are_a_json_dead_letter_not_a_crash() -> None:
    """The rows stay raw until the node's field types are known, and msgspec skips raw
    values by recursing: 5,000 nested arrays there exhaust its stack. A RecursionError
    escaping the intake would leave the message unacked and redelivered for ever. So
    would a later agent's column (read raw, then left out) nested as deep."""
    rows = _keyframe(gpus="DEEP")
    column = _keyframe(static_fields=["temp_c", "hbm_gen", "power_w"], gpus=[[40.0, "DEEP", 1.0]])
    deep = [
        encoded
        for body in (rows, column)
        for encoded in (
            msgspec.msgpack.encode(body).replace(b"\xa4DEEP", b"\x91" * 5000 + b"\x90"),
            msgspec.json.encode(body).replace(b'"DEEP"', b"[" * 5000 + b"]" * 5000),
        )
    ]
    for payload in deep:
        with pytest.raises(EventError) as refused:
            decode_intake(payload, SUBJECT, NOW, book=FactsBook())
        assert refused.value.reason == "json", refused.value.message


def test_the_keyframe_itself_decodes() -> None:
    got = _facts(msgspec.msgpack.encode(_keyframe()), FactsBook())
    assert got.facts[0]["temp_c"] == 40.0 and got.facts[0]["power_limit_w"] == 700.0


def test_messagepack_cut_short_is_a_json_dead_letter() -> None:
    with pytest.raises(EventError) as refused:
        decode_intake(b"\x85\xa1v", SUBJECT, NOW, book=FactsBook())
    assert refused.value.reason == "json"


def test_v2_without_a_book_is_refused_not_misread() -> None:
    payload = wire.TelemetryWriter("agent").encode(NODE, NOW, _gpus())
    with pytest.raises(EventError, match="only v1"):
        decode_intake(payload, SUBJECT, NOW)


def test_a_v2_sample_of_an_h200_is_under_200_bytes_per_gpu(tmp_path: Path) -> None:
    writer = wire.TelemetryWriter("agent")
    gpus = fleet_gpus(tmp_path, NOW)
    keyframe = writer.encode(NODE, NOW, gpus)
    steady = writer.encode(NODE, NOW + 1, gpus)
    v1 = wire.TelemetryWriter("agent", version=1).encode(NODE, NOW, gpus)
    assert len(steady) / len(gpus) <= 200 < len(v1) / len(gpus)
    assert len(keyframe) < len(v1), "even the keyframe is smaller than a v1 sample"


def test_a_v1_sample_written_again_as_v2_keeps_its_own_source_and_facts() -> None:
    v1 = wire.TelemetryWriter("prometheus", version=1).encode(NODE, NOW, _gpus(), "e1")
    line = wire.Expander(2).line(v1)
    assert line is not None and json.loads(line)["source"] == "prometheus"
    assert _facts(line, FactsBook()).facts == _facts(v1, FactsBook()).facts


async def test_a_partition_that_moved_asks_kv_again_at_once() -> None:
    """Review of issue 30: a replica that missed a node's facts in KV, lost the partition
    and got it back (another replica had learnt and saved them meanwhile) refused the
    node's samples without asking KV, for up to MISS_TTL_S after its miss. A partition
    lost forgets its nodes' misses (`Partitions.lose`)."""
    kv = MemoryKV("facts")
    writer, here, there = wire.TelemetryWriter("agent"), FactsBook(kv), FactsBook(kv)
    keyframe = writer.encode(NODE, NOW, _gpus())
    sample = writer.encode(NODE, NOW + 1, _gpus())
    with pytest.raises(FactsUnknown) as missing:
        _facts(sample, here)
    assert not await here.load(NODE, missing.value.facts, NOW + 1), "KV lacks them"
    _facts(keyframe, there)  # the other replica, holding the partition now, learns them
    await there.save(NODE)
    assert not await here.load(NODE, missing.value.facts, NOW + 2), "the miss remembered"
    here.forget_misses({NODE})  # the partition went away (and comes back)
    assert await here.load(NODE, missing.value.facts, NOW + 3)
    assert _facts(sample, here).facts[0]["power_limit_w"] == 700.0


async def test_facts_whose_save_lost_every_try_are_saved_at_the_next_sample() -> None:
    """Review of issue 30: a save that lost its three compare-and-sets to other writers
    dropped the facts silently; a takeover then found KV without them."""

    class Losing(MemoryKV):
        losses = 3

        async def cas(self, key: str, value: bytes, revision: int) -> int | None:
            if self.losses:
                self.losses -= 1
                return None
            return await super().cas(key, value, revision)

    kv = Losing("facts")
    book = FactsBook(kv)
    _facts(wire.TelemetryWriter("agent").encode(NODE, NOW, _gpus()), book)
    await book.save(NODE)
    assert book.unsaved(NODE) and kv.data == {}, "kept for the next sample"
    await book.save(NODE)
    assert not book.unsaved(NODE) and list(kv.data) == [NODE]
