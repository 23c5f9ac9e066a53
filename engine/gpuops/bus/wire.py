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
from datetime import datetime
from typing import Annotated, Any, Literal

import msgspec

from gpuops.clock import rfc3339
from gpuops.models import MAX_GPUS, MAX_MAGNITUDE, NODE_PATTERN, GpuSample

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

_Node = Annotated[str, msgspec.Meta(pattern=NODE_PATTERN)]
_Short = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
_FactsId = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{1,64}$")]


class Static(msgspec.Struct, forbid_unknown_fields=True):
    """A node's static facts: the order of a sample's arrays and each GPU's fixed fields
    (checked by the model's own validator where the engine learns them)."""

    fields: Annotated[list[str], msgspec.Meta(max_length=len(GpuSample.model_fields))]
    gpus: Annotated[list[dict[str, Any]], msgspec.Meta(min_length=1, max_length=MAX_GPUS)]


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


class Kept(msgspec.Struct, forbid_unknown_fields=True):
    """A node's static facts as the engine keeps them in KV, under their id."""

    facts: _FactsId
    static: Static


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


def read(payload: bytes) -> Compact:
    """The envelope of a v2 sample in either encoding; msgspec's errors say what is wrong."""
    return _MSGPACK.decode(payload) if is_msgpack(payload) else _JSON.decode(payload)


def kept(fid: str, static: Static) -> bytes:
    """What KV keeps of a node's static facts."""
    return msgspec.msgpack.encode(Kept(fid, static))


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
    """Decoders of a sample's arrays for one field order, both encodings."""

    def __init__(self, fields: tuple[str, ...]) -> None:
        unknown = [f for f in fields if f not in GpuSample.model_fields]
        if unknown:
            raise ValueError(f"unknown sample field(s): {', '.join(unknown[:5])}")
        if len(set(fields)) != len(fields) or "index" in fields:
            raise ValueError("a sample's fields are each named once, and never `index`")
        row = tuple.__class_getitem__(tuple(_reading(f) for f in fields))
        kind = Annotated[list[row], msgspec.Meta(min_length=1, max_length=MAX_GPUS)]  # type: ignore[valid-type]
        self.fields = fields
        self._msgpack = msgspec.msgpack.Decoder(kind)
        self._json = msgspec.json.Decoder(kind)

    def decode(self, raw: bytes, json: bool) -> list[tuple[Any, ...]]:
        """Each GPU's readings, in `fields` order."""
        return (self._json if json else self._msgpack).decode(raw)


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
        self, node: str, t: float, gpus: list[dict[str, Any]], event_id: str | None = None
    ) -> bytes:
        """One sample of `node`'s GPUs (v1 field names and values) at `t`, on the wire."""
        eid = event_id or uuid.uuid4().hex
        if self.version == 1:
            return _v1(eid, node, t, self.source, gpus)
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
            "source": self.source,
        }
        if last is not None and last[0] == static and t - last[2] < self.every_s:
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

    def forget(self, nodes: Iterable[str]) -> None:
        """Drop what is remembered of nodes this writer no longer speaks for."""
        for node in nodes:
            self._sent.pop(node, None)


def _v1(eid: str, node: str, t: float, source: str, gpus: list[dict[str, Any]]) -> bytes:
    envelope = {"id": eid, "kind": "telemetry", "node": node, "ts": rfc3339(t), "source": source}
    return msgspec.json.encode({**envelope, "data": {"gpus": gpus}})


# --- files: `gpuops export` writes either format from either ------------------------


class Expander:
    """Telemetry samples, as read off the stream in either format, as file lines of one:
    v1 (every field, a v2 sample joined to its node's static facts) or v2 as JSON (the
    first line of each node, and the first after its facts change, carries them).

    A v2 sample's facts are the last keyframe of its node read here, else what `kept`
    answers (the engine's KV copy); a sample of neither is `unjoined`.
    """

    def __init__(self, version: int) -> None:
        if version not in (1, V2):
            raise ValueError(f"telemetry format v{version}: files hold v1 or v2")
        self.version = version
        self._facts: dict[str, Kept] = {}
        self._written: dict[str, str] = {}  # node -> the facts id its static went out with
        self._json = TelemetryWriter("export", json=True, every_s=float("inf"))
        self.unjoined = 0

    def needs(self, payload: bytes) -> str | None:
        """The node whose kept facts a v2 sample needs (its own are not here), or None."""
        if not is_msgpack(payload):
            return None
        doc = _MSGPACK.decode(payload)
        known = self._facts.get(doc.node)
        fresh = doc.static is None and (known is None or known.facts != doc.facts)
        return doc.node if fresh else None

    def learn(self, node: str, kept: Kept) -> None:
        """Static facts of `node` from elsewhere (KV)."""
        self._facts[node] = kept

    def line(self, payload: bytes) -> bytes | None:
        """One line of the chosen format; None where a v2 sample cannot be joined to v1."""
        if not is_v2(payload):
            return self._from_v1(payload)
        doc = read(payload)
        if doc.static is not None:
            self._facts[doc.node] = Kept(doc.facts, doc.static)
        kept = self._facts.get(doc.node)
        if kept is None or kept.facts != doc.facts:
            self.unjoined += 1
            return self._compact(doc, None) if self.version == V2 else None
        table = rows(tuple(kept.static.fields)).decode(doc.gpus, not is_msgpack(payload))
        return self._compact(doc, kept, table) if self.version == V2 else self._v1(doc, kept, table)

    def _from_v1(self, payload: bytes) -> bytes:
        if self.version == 1:
            return payload
        event = msgspec.json.decode(payload)
        t = _epoch(event["ts"])
        return self._json.encode(event["node"], t, event["data"]["gpus"], event["id"])

    def _compact(
        self, doc: Compact, kept: Kept | None, table: list[tuple[Any, ...]] | None = None
    ) -> bytes:
        body: dict[str, Any] = {"v": V2, "id": doc.id, "kind": "telemetry", "node": doc.node}
        body |= {"ts": doc.ts, "source": doc.source, "facts": doc.facts}
        if kept is not None and self._written.get(doc.node) != kept.facts:
            body["static"] = kept.static
            self._written[doc.node] = kept.facts
        body["gpus"] = table if table is not None else msgspec.msgpack.decode(doc.gpus)
        return msgspec.json.encode(body)

    def _v1(self, doc: Compact, kept: Kept, table: list[tuple[Any, ...]]) -> bytes:
        fields = kept.static.fields
        gpus = []
        for static, row in zip(kept.static.gpus, table, strict=True):
            readings = {f: v for f, v in zip(fields, row, strict=True) if v is not None}
            gpus.append({**static, **readings})
        return _v1(doc.id, doc.node, doc.ts, doc.source, gpus)


def _epoch(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
