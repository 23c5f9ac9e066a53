"""Telemetry format v2 on the wire: a node's static facts once, then arrays of readings.

Format v1 sends every field of every GPU every second, about 1 KB of JSON per GPU
sample, of which half never changes (uuid, name, thresholds, limits, maxima, modes).
A v2 sample carries the changing readings only, one fixed-order array per GPU, and the
id of the node's static facts it goes with; the sample that comes first after the agent
starts, after those facts change, and every `KEYFRAME_EVERY_S` carries the facts
themselves (`static`: the arrays' field names and each GPU's static fields). So the
facts travel in order with the samples, on the node's own subject and under its own
signature, and a lost keyframe costs at most one interval.

On the bus a v2 sample is MessagePack (chosen by measurement: 122 bytes per H200 GPU
sample against 156 as JSON arrays and 990 as v1, and a little faster to decode; see
docs/events.md); in files (`gpuops export`, recordings for `replay`) it is the same
object as JSON. msgspec decodes both straight into typed tuples, every number with the
model's bounds, without an object per GPU.
"""

from __future__ import annotations

import functools
import hashlib
import re
import typing
import uuid
from collections.abc import Iterable
from typing import Annotated, Any, Literal

import msgspec
from pydantic import ValidationError

from gpuops import subjects
from gpuops.clock import rfc3339, to_datetime
from gpuops.models import (
    EVENT_ADAPTER,
    MAX_GPUS,
    MAX_MAGNITUDE,
    NODE_PATTERN_PY,
    GpuSample,
    TelemetryEvent,
)

V2 = 2
# The fields a writer sends in the keyframe, not in every sample: what NVML reports
# once (identity, thresholds, maxima) or changes only when someone changes it (a power
# limit, an application clock, a mode) or a job starts (the pod). `index` places each
# GPU's array.
STATIC_FIELDS: tuple[str, ...] = (
    "index",
    "uuid",
    "name",
    "temp_slowdown_c",
    "temp_shutdown_c",
    "temp_gpu_max_c",
    "temp_mem_max_c",
    "power_limit_w",
    "power_default_limit_w",
    "power_min_limit_w",
    "power_max_limit_w",
    "app_clock_sm_mhz",
    "max_clock_sm_mhz",
    "mem_total_bytes",
    "pcie_max_gen",
    "pcie_max_width",
    "persistence_mode",
    "ecc_mode",
    "mig_mode",
    "compute_mode",
    "pod",
    "namespace",
    "container",
    "labels",
)
# Everything else, in the model's order: the arrays of a sample this version writes.
SAMPLE_FIELDS: tuple[str, ...] = tuple(f for f in GpuSample.model_fields if f not in STATIC_FIELDS)
# A keyframe this often even when nothing changed: an engine that lost the facts (its
# KV gone, a keyframe dropped with the stream full) joins again within this long.
KEYFRAME_EVERY_S = 120.0
# The largest epoch a v1 timestamp can have (9999-12-31T23:59:59Z).
MAX_EPOCH = 253402300799.0

# A sample's arrays and a GPU's static fields may name fields a later version adds (the
# engine ignores them, as v1 ignores a field it does not know), within these bounds.
MAX_FIELDS = 128
_Name = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
_Node = Annotated[str, msgspec.Meta(pattern=NODE_PATTERN_PY)]
_Short = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
_FactsId = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{1,64}$")]
# A static value is a scalar or a flat map of text (a series' labels): nothing nested,
# so no keyframe can carry a structure deep enough to exhaust the decoder's stack.
_Value = str | int | float | bool | None | dict[str, str]
_Gpu = Annotated[dict[_Name, _Value], msgspec.Meta(max_length=MAX_FIELDS)]


class Static(msgspec.Struct, forbid_unknown_fields=True):
    """A node's static facts: the order of a sample's arrays and each GPU's fixed fields
    (checked by the model's own validator where the engine learns them)."""

    fields: Annotated[list[_Name], msgspec.Meta(max_length=MAX_FIELDS)]
    gpus: Annotated[list[_Gpu], msgspec.Meta(min_length=1, max_length=MAX_GPUS)]


class Compact(msgspec.Struct, forbid_unknown_fields=True):
    """A v2 telemetry sample as it arrives: the envelope, the facts it goes with, the
    static facts where this one is a keyframe, and the rows still undecoded (their types
    are the node's `fields`, known once the facts are)."""

    v: Literal[2]
    id: _Short
    kind: Literal["telemetry"]
    node: _Node
    ts: Annotated[float, msgspec.Meta(ge=0, le=MAX_EPOCH)]
    source: _Short
    facts: _FactsId
    gpus: msgspec.Raw
    static: Static | None = None

    @property
    def epoch(self) -> float:
        """The sample's own time, in epoch seconds (as an event's)."""
        return self.ts


class Kept(msgspec.Struct, forbid_unknown_fields=True):
    """A node's static facts as the engine keeps them in KV, under their id, with the
    time of the sample that carried them (a later owner's newer facts are not replaced)."""

    facts: _FactsId
    static: Static
    at: float = 0.0


_MSGPACK = msgspec.msgpack.Decoder(Compact)
_JSON = msgspec.json.Decoder(Compact)
_KEPT = msgspec.msgpack.Decoder(Kept)


def is_msgpack(payload: bytes) -> bool:
    """A MessagePack map (its first byte 0x80-0x8f, 0xde or 0xdf: never JSON's, whose
    text starts with `{`, `[`, a letter, a digit or white space)."""
    return bool(payload) and (0x80 <= payload[0] <= 0x8F or payload[0] in (0xDE, 0xDF))


def is_v2(payload: bytes) -> bool:
    """Telemetry v2: MessagePack, or JSON whose first key is `"v": 2` (as it is written)."""
    return is_msgpack(payload) or _V2_JSON.match(payload) is not None


_V2_JSON = re.compile(rb'\s*\{\s*"v"\s*:\s*2\s*[,}]')


def _decoded(decoder: Any, payload: bytes) -> Any:
    """`decoder.decode(payload)`, a nesting deeper than msgspec recurses (it skips raw
    values and unknown fields by recursing) raised as msgspec's DecodeError, as any other
    undecodable payload: every caller already tells that apart, none a RecursionError."""
    try:
        return decoder.decode(payload)
    except RecursionError as exc:
        raise msgspec.DecodeError("nested deeper than a sample is") from exc


def read(payload: bytes) -> Compact:
    """The envelope of a v2 sample in either encoding; msgspec's errors say what is wrong."""
    return _decoded(_MSGPACK if is_msgpack(payload) else _JSON, payload)  # type: ignore[no-any-return]


class _NodeOnly(msgspec.Struct):
    node: _Node


_NODE_MSGPACK = msgspec.msgpack.Decoder(_NodeOnly)
_NODE_JSON = msgspec.json.Decoder(_NodeOnly)


def node_of(payload: bytes) -> str:
    """The node a v2 sample names, its other fields skipped unchecked (`gpuops replay`'s
    first pass); msgspec's errors say what is wrong."""
    return _decoded(_NODE_MSGPACK if is_msgpack(payload) else _NODE_JSON, payload).node  # type: ignore[no-any-return]


def kept(fid: str, static: Static, at: float) -> bytes:
    """What KV keeps of a node's static facts, learnt from a sample at `at`."""
    return msgspec.msgpack.encode(Kept(fid, static, at))


def read_kept(payload: bytes) -> Kept:
    """A node's static facts as KV kept them."""
    return _KEPT.decode(payload)


def facts_id(static: Static) -> str:
    """The static facts' id: a hash of their MessagePack form (the same facts, the same id)."""
    return hashlib.blake2b(msgspec.msgpack.encode(static), digest_size=8).hexdigest()


# --- rows: one typed tuple per GPU --------------------------------------------------


def _reading(name: str) -> Any:
    """A sample field's msgspec type, with the model's bounds: numbers within
    +-MAX_MAGNITUDE (msgspec refuses NaN and infinity against them), integers within
    what MessagePack and msgspec hold (64 bits), flags as true/false; null where NVML
    has no reading."""
    base = next(
        a for a in typing.get_args(GpuSample.model_fields[name].annotation) if a is not type(None)
    )
    if typing.get_origin(base) is Annotated:
        base = typing.get_args(base)[0]
    kinds: dict[Any, Any] = {
        float: Annotated[float, msgspec.Meta(ge=-MAX_MAGNITUDE, le=MAX_MAGNITUDE)],
        int: int,
        bool: bool,
    }
    if base not in kinds:
        raise ValueError(f"{name} is not a reading a sample's array can carry")
    return kinds[base] | None


class Rows:
    """Decoders of a sample's arrays for one field order, both encodings. A column this
    version does not know (a later agent's) is read as raw bytes and left out of the
    facts, as v1 leaves out a field it does not know."""

    def __init__(self, fields: tuple[str, ...]) -> None:
        if len(set(fields)) != len(fields) or "index" in fields:
            raise ValueError("a sample's fields are each named once, and never `index`")
        known = [f in GpuSample.model_fields for f in fields]
        types = [_reading(f) if k else msgspec.Raw for f, k in zip(fields, known, strict=True)]
        row = tuple.__class_getitem__(tuple(types))
        kind = Annotated[list[row], msgspec.Meta(min_length=1, max_length=MAX_GPUS)]  # type: ignore[valid-type]
        self.fields = fields
        # The columns the facts take (None: all of them, the usual case).
        self.keep: tuple[int, ...] | None = (
            None if all(known) else tuple(i for i, k in enumerate(known) if k)
        )
        self._msgpack = msgspec.msgpack.Decoder(kind)
        self._json = msgspec.json.Decoder(kind)
        # A whole sample whose arrays are in this order, in one parse: the envelope's
        # checks are Compact's, the arrays' these (FactsBook.read tries it first).
        whole = msgspec.defstruct("Sample", [("gpus", kind)], bases=(Compact,))
        self._whole_msgpack = msgspec.msgpack.Decoder(whole)
        self._whole_json = msgspec.json.Decoder(whole)
        self.facts = _joiner(fields, self.keep)

    def decode(self, raw: bytes, json: bool) -> list[tuple[Any, ...]]:
        """Each GPU's readings, in `fields` order; a wrong one names its field."""
        try:
            return _decoded(self._json if json else self._msgpack, raw)  # type: ignore[no-any-return]
        except msgspec.ValidationError as exc:
            raise msgspec.ValidationError(self._named(str(exc))) from exc

    def sample(self, payload: bytes) -> Compact:
        """A v2 sample read whole, its `gpus` already rows of this order; msgspec's
        DecodeError when it is not such a sample (read it as `read` does then)."""
        whole = self._whole_msgpack if is_msgpack(payload) else self._whole_json
        return _decoded(whole, payload)  # type: ignore[no-any-return]

    def pairs(self, row: tuple[Any, ...]) -> Iterable[tuple[str, Any]]:
        """A row's (field, reading) pairs the facts take."""
        if self.keep is None:
            return zip(self.fields, row, strict=False)  # the decoder's row type fixes its length
        return ((self.fields[i], row[i]) for i in self.keep)

    def _named(self, text: str) -> str:
        found = _AT.search(text)
        if found is None:
            return text
        gpu, column = int(found.group(1)), int(found.group(2))
        name = self.fields[column] if column < len(self.fields) else f"column {column}"
        return f"{text} (GPU array {gpu}, field {name})"


_AT = re.compile(r"\$\[(\d+)\]\[(\d+)\]")

Joiner = typing.Callable[
    [Iterable[dict[str, Any]], Iterable[tuple[Any, ...]]], list[dict[str, Any]]
]


def _joiner(fields: tuple[str, ...], keep: tuple[int, ...] | None) -> Joiner:
    """A function that makes each GPU's facts: its template copied, its row's readings
    stored by name. Generated per field order: a store per field is a third cheaper than
    `update` from pairs, and this runs for every GPU sample. The names in the source are
    model fields only (a column this version does not know is never kept), quoted."""
    taken = range(len(fields)) if keep is None else keep
    stores = "".join(f"        f[{fields[i]!r}] = r[{i}]\n" for i in taken)
    source = (
        "def facts(templates, rows):\n"
        "    out = []\n"
        "    for t, r in zip(templates, rows):\n"
        "        f = t.copy()\n"
        f"{stores}"
        "        out.append(f)\n"
        "    return out\n"
    )
    namespace: dict[str, Any] = {"zip": zip}
    exec(compile(source, f"<facts of {len(fields)} fields>", "exec"), namespace)
    joiner: Joiner = namespace["facts"]
    return joiner


@functools.lru_cache(maxsize=64)
def rows(fields: tuple[str, ...]) -> Rows:
    """The decoders of one field order (a fleet has a handful of agent versions)."""
    return Rows(fields)


# --- the writer: agents, sources, the simulated fleet ------------------------------


class TelemetryWriter:
    """Encodes telemetry samples for the nodes one publisher speaks for, as v2 (or v1).

    Per node it remembers the static facts last sent and when: a sample whose static
    part differs, the first one, one after `lost(node)`, and one every `every_s` carry
    them. The clock is the sample's own time, so the simulated fleet's virtual time and
    an agent's wall time behave alike.
    """

    def __init__(
        self,
        source: str,
        *,
        version: int = V2,
        every_s: float = KEYFRAME_EVERY_S,
        json: bool = False,
        fields: tuple[str, ...] = SAMPLE_FIELDS,
    ) -> None:
        if version not in (1, V2):
            raise ValueError(f"telemetry format v{version}: this writer knows v1 and v2")
        self.source = source
        self.version = version
        self.every_s = every_s
        self.fields = fields
        self._encode = msgspec.json.encode if json else msgspec.msgpack.encode
        self._sent: dict[str, tuple[list[dict[str, Any]], str, float]] = {}
        self.keyframes = 0

    def encode(
        self,
        node: str,
        t: float,
        gpus: list[dict[str, Any]],
        event_id: str | None = None,
        source: str | None = None,
    ) -> bytes:
        """One sample of `node`'s GPUs (v1 field names and values) at `t`, on the wire,
        from this writer's source (or `source`: a sample written again keeps its own)."""
        eid = event_id or uuid.uuid4().hex
        source = source or self.source
        if self.version == 1:
            return _v1(eid, node, t, source, gpus)
        t = to_ms(t)
        fields = self.fields
        static = [{k: v for k, v in g.items() if k not in fields and v is not None} for g in gpus]
        rows = [[g.get(f) for f in fields] for g in gpus]
        last = self._sent.get(node)
        body: dict[str, Any] = {
            "v": V2,
            "id": eid,
            "kind": "telemetry",
            "node": node,
            "ts": t,
            "source": source,
        }
        # A clock stepped back counts as time passed: the keyframes go on.
        if last is not None and last[0] == static and abs(t - last[2]) < self.every_s:
            body["facts"] = last[1]
        else:
            facts = Static(list(fields), static)
            body["facts"] = fid = facts_id(facts)
            body["static"] = facts
            self._sent[node] = (static, fid, t)
            self.keyframes += 1
        body["gpus"] = rows
        return self._encode(body)

    def lost(self, node: str) -> None:
        """The last sample of `node` may not have arrived: the next one is a keyframe."""
        self._sent.pop(node, None)


def to_ms(t: float) -> float:
    """`t` cut to the millisecond, as v1's RFC 3339 time says it: the same sample has the
    same time in both formats."""
    moment = to_datetime(t)
    return moment.replace(microsecond=moment.microsecond // 1000 * 1000).timestamp()


def _v1(eid: str, node: str, t: float, source: str, gpus: list[dict[str, Any]]) -> bytes:
    envelope = {"id": eid, "kind": "telemetry", "node": node, "ts": rfc3339(t), "source": source}
    return msgspec.json.encode({**envelope, "data": {"gpus": gpus}})


# --- files: `gpuops export` writes either format from either ------------------------


class Expander:
    """Telemetry samples, as read off the stream in either format, as file lines of one:
    v1 (every field, a v2 sample joined to its node's static facts) or v2 as JSON (the
    first line of each node, and the first after its facts change, carries them).

    A v2 sample's facts are the last keyframe of its node read here (from a message on
    that node's own subject, whose facts id is the hash of its facts), else what the
    caller finds in the engine's KV copy (`needs`, `learn`); a sample of neither is
    `unjoined`. Values are not checked here: `replay` checks each line as the intake
    does, and a v1 sample that the intake would refuse is written as it came.
    """

    def __init__(self, version: int) -> None:
        if version not in (1, V2):
            raise ValueError(f"telemetry format v{version}: files hold v1 or v2")
        self.version = version
        self._facts: dict[str, Kept] = {}
        self._written: dict[str, str] = {}  # node -> the facts id its static went out with
        self._json = TelemetryWriter("", json=True, every_s=float("inf"))  # each its own source
        self.unjoined = 0

    def needs(self, doc: Compact) -> bool:
        """Whether a v2 sample needs its node's kept facts (its own are not here)."""
        known = self._facts.get(doc.node)
        return doc.static is None and (known is None or known.facts != doc.facts)

    def learn(self, node: str, kept: Kept) -> None:
        """Static facts of `node` from elsewhere (KV)."""
        self._facts[node] = kept

    def line(
        self, payload: bytes, doc: Compact | None = None, node_token: str | None = None
    ) -> bytes | None:
        """One line of the chosen format (`doc`: the payload's v2 envelope, when read
        already); None where a v2 sample cannot be joined to v1. With `node_token` (the
        subject's), a keyframe about another node teaches nothing."""
        if doc is None:
            if not is_v2(payload):
                return self._from_v1(payload)
            doc = read(payload)
        json = not is_msgpack(payload)
        own = node_token is None or subjects.token(doc.node) == node_token
        if doc.static is not None and own and facts_id(doc.static) == doc.facts:
            self._facts[doc.node] = Kept(doc.facts, doc.static, doc.ts)
        kept = self._facts.get(doc.node)
        if kept is None or kept.facts != doc.facts:
            self.unjoined += 1
            if self.version == 1:
                return None
            raw = _decoded(msgspec.json if json else msgspec.msgpack, doc.gpus)
            return self._compact(doc, None, raw)
        table = rows(tuple(kept.static.fields)).decode(doc.gpus, json)
        return self._compact(doc, kept, table) if self.version == V2 else self._v1(doc, kept, table)

    def _from_v1(self, payload: bytes) -> bytes:
        """A v1 sample as v1, or as v2 from the values the model reads in it (a sample
        it refuses stays as it came, for replay to refuse by the same reason)."""
        if self.version == 1:
            return payload
        try:
            event = EVENT_ADAPTER.validate_json(payload)
        except ValidationError:
            return payload
        if not isinstance(event, TelemetryEvent):
            return payload
        gpus = [g.model_dump(exclude_none=True) for g in event.data.gpus]
        return self._json.encode(event.node, event.epoch, gpus, event.id, event.source)

    def _compact(self, doc: Compact, kept: Kept | None, table: list[Any]) -> bytes:
        body: dict[str, Any] = {"v": V2, "id": doc.id, "kind": "telemetry", "node": doc.node}
        body |= {"ts": doc.ts, "source": doc.source, "facts": doc.facts}
        if kept is not None and self._written.get(doc.node) != kept.facts:
            body["static"] = kept.static
            self._written[doc.node] = kept.facts
        body["gpus"] = table
        return msgspec.json.encode(body)

    def _v1(self, doc: Compact, kept: Kept, table: list[tuple[Any, ...]]) -> bytes:
        shape = rows(tuple(kept.static.fields))
        gpus = []
        for static, row in zip(kept.static.gpus, table, strict=True):
            readings = {f: v for f, v in shape.pairs(row) if v is not None}
            gpus.append({**static, **readings})
        return _v1(doc.id, doc.node, doc.ts, doc.source, gpus)
