"""Telemetry v2 to facts: each node's static facts kept (in memory and in KV), joined to
every sample's arrays at decode, so rules see the same fields as from v1.

A keyframe's static facts are checked by the model's own validator (`GpuSample`, with
its bounds and its cut of free text) once, when learnt; a sample's arrays by msgspec
with the same bounds (gpuops.bus.wire). The facts go to KV (`Buckets.facts`, written by
engines only) before the sample is handled, so a replica that takes the node's
partition over reads them there at the node's first sample; one that finds no facts,
or others than the sample names, refuses the sample as `facts_unknown` until the
agent's next keyframe (at most `wire.KEYFRAME_EVERY_S`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import msgspec
from pydantic import ValidationError

from gpuops.bus import wire
from gpuops.bus.store import KV, kv_key
from gpuops.errors import EventError
from gpuops.match.facts import Fact, Telemetry, with_derived, with_medians
from gpuops.models import GpuSample

log = logging.getLogger(__name__)

# Nodes whose facts one engine keeps in memory (a site's fleet, with room): past it the
# longest-unseen node's are dropped, read again from KV at its next sample.
MAX_NODES = 250_000


class FactsUnknown(EventError):
    """A sample names static facts this engine does not have (yet)."""

    def __init__(self, node: str, facts: str, had: str | None) -> None:
        had_text = f"it has {had}" if had else "it has none"
        super().__init__(
            "facts_unknown",
            f"sample of {node} goes with static facts {facts}; {had_text} "
            f"(the agent sends them again within {wire.KEYFRAME_EVERY_S:.0f} s)",
        )
        self.node = node
        self.facts = facts


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """One node's static facts as the decoder uses them."""

    id: str
    rows: wire.Rows
    templates: tuple[Fact, ...]  # per GPU: every fact's key, the static ones filled
    encoded: bytes  # what KV keeps (wire.Kept)


class FactsBook:
    """The static facts of the nodes an engine reads, and the join of v2 samples to them.

    `kv` None: in memory only (replay, test-rules, the shadow). Learning is synchronous
    (the decode is); `save` writes a node's facts learnt here, and `load` reads a node's
    facts a sample names but this book lacks. A node is in one partition, so one intake
    saves and loads it.
    """

    def __init__(self, kv: KV | None = None, max_nodes: int = MAX_NODES) -> None:
        self.kv = kv
        self.max_nodes = max_nodes
        self._nodes: dict[str, NodeFacts] = {}
        self._unsaved: dict[str, NodeFacts] = {}
        self._missed: dict[str, str] = {}  # node -> the facts id KV did not have
        self.learnt = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def facts_of(self, node: str) -> NodeFacts | None:
        """What this book holds for `node`."""
        return self._nodes.get(node)

    # --- decoding -----------------------------------------------------------------

    def telemetry(self, payload: bytes, publisher: str = "") -> Telemetry:
        """A v2 sample (MessagePack or JSON) as facts; EventError with the dead-letter
        reason when it does not decode, or FactsUnknown when its facts are not here."""
        json = not wire.is_msgpack(payload)
        try:
            doc = wire.read(payload)
        except msgspec.ValidationError as exc:
            raise EventError("schema", f"telemetry v2: {exc}") from exc
        except msgspec.DecodeError as exc:
            raise EventError("json", f"telemetry v2: neither JSON nor MessagePack ({exc})") from exc
        known = self._nodes.get(doc.node)
        if doc.static is not None and (known is None or known.id != doc.facts):
            known = self._learn(doc.node, doc.facts, doc.static)
        if known is None or known.id != doc.facts:
            raise FactsUnknown(doc.node, doc.facts, known.id if known else None)
        self._touch(doc.node, known)
        try:
            rows = known.rows.decode(doc.gpus, json)
        except msgspec.DecodeError as exc:
            raise EventError("schema", f"telemetry v2 gpus: {exc}") from exc
        templates = known.templates
        if len(rows) != len(templates):
            raise EventError(
                "schema", f"telemetry v2: {len(rows)} GPU arrays for {len(templates)} GPUs' facts"
            )
        fields = known.rows.fields
        facts = []
        for template, row in zip(templates, rows, strict=True):
            fact = template.copy()
            fact.update(zip(fields, row, strict=True))  # msgspec checked each length
            facts.append(fact)
        with_medians(facts)
        return Telemetry(doc.id, doc.node, doc.ts, doc.source, facts, publisher=publisher)

    def _learn(self, node: str, fid: str, static: wire.Static) -> NodeFacts:
        learnt = _node_facts(node, fid, static)
        self._touch(node, learnt)
        self._missed.pop(node, None)
        if self.kv is not None:
            self._unsaved[node] = learnt
        self.learnt += 1
        return learnt

    def _touch(self, node: str, facts: NodeFacts) -> None:
        """Keep `node`'s facts as the most recently seen; drop the oldest past the bound."""
        self._nodes.pop(node, None)
        self._nodes[node] = facts
        while len(self._nodes) > self.max_nodes:
            del self._nodes[next(iter(self._nodes))]

    # --- KV -----------------------------------------------------------------------

    def unsaved(self, node: str) -> bool:
        """Whether `node`'s facts were learnt here and are not yet in KV."""
        return node in self._unsaved and self.kv is not None

    async def save(self, node: str) -> None:
        """Write `node`'s facts learnt here to KV (the intake does, before it handles the
        sample that carried them). When KV fails they stay for the node's next sample:
        the sample is decoded all the same, and losing the KV copy costs a takeover one
        keyframe interval, not a sample."""
        facts = self._unsaved.pop(node, None)
        if facts is None or self.kv is None:
            return
        try:
            await self.kv.put(kv_key(node), facts.encoded)
        except BaseException:
            self._unsaved.setdefault(node, facts)  # unless newer facts came meanwhile
            raise

    async def load(self, node: str, wanted: str) -> bool:
        """Read `node`'s facts from KV; False when they are not the `wanted` ones (none,
        others, or not decodable). A miss is remembered: the node's next samples, until
        its keyframe, do not ask KV again (only this replica writes the node's facts while
        it owns the partition, so KV will not gain them meanwhile)."""
        if self.kv is None or self._missed.get(node) == wanted:
            return False
        entry = await self.kv.get(kv_key(node))
        facts = None if entry is None else self._kept(node, entry.value)
        if facts is None or facts.id != wanted:
            self._missed[node] = wanted
            while len(self._missed) > self.max_nodes:
                del self._missed[next(iter(self._missed))]
            return False
        self._touch(node, facts)
        return True

    @staticmethod
    def _kept(node: str, value: bytes) -> NodeFacts | None:
        try:
            kept = wire.read_kept(value)
            return _node_facts(node, kept.facts, kept.static)
        except (msgspec.DecodeError, EventError) as exc:
            log.warning("static facts of %s in KV do not decode: %s", node, exc)
            return None


def _node_facts(node: str, fid: str, static: wire.Static) -> NodeFacts:
    """Check a keyframe's facts and build the templates (every model field, then what
    the matcher adds: `node`, `gpu`, the medians, as v1's facts have them); EventError
    ("schema") when bad."""
    fields = tuple(static.fields)
    try:
        rows = wire.rows(fields)
    except ValueError as exc:
        raise EventError("schema", f"telemetry v2 static.fields: {exc}") from exc
    templates = []
    for i, gpu in enumerate(static.gpus):
        both = sorted(set(gpu) & set(fields))
        if both:
            raise EventError("schema", f"telemetry v2 static.gpus.{i}: {both[0]} is also in fields")
        try:
            model = GpuSample.model_validate(gpu)
        except ValidationError as exc:
            first = exc.errors(include_url=False)[0]
            where = ".".join(map(str, first["loc"]))
            raise EventError(
                "schema", f"telemetry v2 static.gpus.{i}.{where}: {first['msg']}"
            ) from exc
        templates.append(with_derived([dict(model.__dict__)], node)[0])
    return NodeFacts(fid, rows, tuple(templates), wire.kept(fid, static))
