"""Telemetry v2 to facts: each node's static facts kept (in memory and in KV), joined to
every sample's arrays at decode, so rules see the same fields as from v1.

A sample is read in two steps so that nothing is learnt from one the intake refuses:
`read` decodes its envelope (the intake then checks its subject, so its publisher
spoke for this node, and its time), and `join` checks the rest and joins it. A
keyframe's static facts must hash to the id it gives; they are checked as the model
checks them (`GpuSample`'s fields, with their bounds and cut of free text: the fast
reader's schema, gpuops.intake.fastdecode) and its arrays by msgspec with the same
bounds (gpuops.bus.wire), and only a keyframe valid throughout is learnt. The facts go
to KV (`Buckets.facts`, written by engines only) before the sample is handled, so a
replica that takes the node's partition over reads them there at the node's first
sample; one that finds no facts, or others than the sample names, refuses the sample
as `facts_unknown` until the agent's next keyframe.
"""

from __future__ import annotations

import logging
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from pydantic import ValidationError

from gpuops.bus import wire
from gpuops.bus.store import KV, kv_key
from gpuops.errors import EventError
from gpuops.intake.fastdecode import gpu_facts
from gpuops.match.facts import Fact, Telemetry, with_medians

log = logging.getLogger(__name__)

# Nodes whose facts one engine keeps in memory (a site's fleet, with room): past it the
# longest-unseen node's are dropped, read again from KV at its next sample. Only nodes
# the inventory knows are kept (`known`), so a source that may speak for any node
# cannot fill it with made-up ones.
MAX_NODES = 250_000
# Samples in a row joined in another array order before `read` tries that one first.
SWITCH_AFTER = 8
# A KV miss is remembered this long (event time): the node's samples until then do not
# ask KV again. Longer would outlive a partition that moved away and came back.
MISS_TTL_S = 30.0


class FactsUnknown(EventError):
    """A sample names static facts this engine does not have (yet)."""

    def __init__(self, node: str, facts: str, had: str | None, at: float) -> None:
        had_text = f"it has {had}" if had else "it has none"
        super().__init__(
            "facts_unknown",
            f"sample of {node} goes with static facts {facts}; {had_text} (the agent sends "
            f"them again at its next keyframe, every {wire.KEYFRAME_EVERY_S:.0f} s by default)",
        )
        self.node = node
        self.facts = facts
        self.at = at


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """One node's static facts as the decoder uses them."""

    id: str
    rows: wire.Rows
    templates: tuple[Fact, ...]  # per GPU: every fact's key, the static ones filled
    labels: bool  # some GPU has labels: a sample's facts get their own copy


class FactsBook:
    """The static facts of the nodes an engine reads, and the join of v2 samples to them.

    `kv` None: in memory only (replay, test-rules, the shadow). `known` says which nodes
    the inventory has: another's samples are joined (the pipeline then counts them as
    about an unknown host) but their facts are not kept. Learning is synchronous (the
    decode is); `save` writes a node's facts learnt here, and `load` reads a node's
    facts a sample names but this book lacks. A node is in one partition, whose one
    telemetry intake saves and loads it.
    """

    def __init__(
        self,
        kv: KV | None = None,
        max_nodes: int = MAX_NODES,
        known: Callable[[str], bool] | None = None,
    ) -> None:
        self.kv = kv
        self.max_nodes = max_nodes
        self.known = known
        self._nodes: dict[str, NodeFacts] = {}
        self._unsaved: dict[str, tuple[bytes, float]] = {}  # node -> (wire.Kept, its time)
        self._missed: dict[str, tuple[str, float]] = {}  # node -> facts id KV lacked, when
        self.learnt = 0
        # The array order `read` tries in one parse: the last one joined, kept until
        # SWITCH_AFTER samples in a row had another (a fleet mid-upgrade has two; the
        # larger keeps it).
        self._whole: wire.Rows | None = None
        self._others = 0

    def __len__(self) -> int:
        return len(self._nodes)

    def facts_of(self, node: str) -> NodeFacts | None:
        """What this book holds for `node`."""
        return self._nodes.get(node)

    # --- decoding -----------------------------------------------------------------

    def read(self, payload: bytes) -> wire.Compact:
        """A v2 sample's envelope (MessagePack or JSON); EventError when it does not decode.

        A sample whose arrays are in the order this book read last comes back with its
        rows decoded, in one parse, when the node it names has that order (its facts
        here, or the keyframe's own); any other is read as an envelope with its arrays
        left raw, decoded in `join` by the node's order (a sample that is not valid
        throughout is read so too: the errors are the envelope's and the arrays' own)."""
        whole = self._whole
        if whole is not None:
            try:
                doc = whole.sample(payload)
            except msgspec.DecodeError:
                pass
            else:
                if self._order_of(doc) is whole:
                    return doc
        try:
            return wire.read(payload)
        except msgspec.ValidationError as exc:
            raise EventError("schema", f"telemetry v2: {exc}") from exc
        except msgspec.DecodeError as exc:
            raise EventError("json", f"telemetry v2: neither JSON nor MessagePack ({exc})") from exc

    def _order_of(self, doc: wire.Compact) -> wire.Rows | None:
        """The order `join` reads the arrays of `doc` in: the facts this book has under
        the id it gives, else its keyframe's (None: neither). A keyframe of the facts
        held is joined to those, so their order decides, not its static's (one that
        does not hash to the id is refused in `join`)."""
        known = self._nodes.get(doc.node)
        if known is not None and known.id == doc.facts:
            return known.rows
        if doc.static is not None:
            try:
                return wire.rows(tuple(doc.static.fields))
            except ValueError:
                return None  # refused in `join`, read the long way
        return None

    def telemetry(self, payload: bytes, publisher: str = "") -> Telemetry:
        """`read` then `join`, for a sample with no subject to check (replay, publish)."""
        return self.join(self.read(payload), not wire.is_msgpack(payload), publisher)

    def join(self, doc: wire.Compact, json: bool, publisher: str = "") -> Telemetry:
        """The facts of a sample the intake has checked the envelope of; EventError with
        the dead-letter reason, or FactsUnknown when its facts are not here."""
        known = self._nodes.get(doc.node)
        if doc.static is not None and (known is None or known.id != doc.facts):
            learnt = _node_facts(doc.node, doc.facts, doc.static)
            telemetry = _joined(doc, json, learnt, publisher)  # valid throughout, or raises
            self._learn(doc.node, learnt, doc)
            self._joined_order(learnt.rows)
            return telemetry
        if known is None or known.id != doc.facts:
            raise FactsUnknown(doc.node, doc.facts, known.id if known else None, doc.ts)
        if doc.static is not None:
            # A keyframe of the facts held: its static must still be what the id hashes
            # (the arrays are joined by the held order; a static naming another would
            # have them read in one order and stored by the other).
            _hashed(doc.facts, doc.static)
        self._touch(doc.node, known)
        telemetry = _joined(doc, json, known, publisher)
        self._joined_order(known.rows)
        return telemetry

    def _joined_order(self, rows: wire.Rows) -> None:
        if rows is self._whole:
            self._others = 0
            return
        self._others += 1
        if self._whole is None or self._others >= SWITCH_AFTER:
            self._whole, self._others = rows, 0

    def _learn(self, node: str, facts: NodeFacts, doc: wire.Compact) -> None:
        if self.known is not None and not self.known(node):
            return  # joined once, kept nowhere: the pipeline refuses its host
        assert doc.static is not None
        self._touch(node, facts)
        self._missed.pop(node, None)
        if self.kv is not None:
            self._unsaved[node] = (wire.kept(facts.id, doc.static, doc.ts), doc.ts)
        self.learnt += 1

    def _touch(self, node: str, facts: NodeFacts) -> None:
        """Keep `node`'s facts as the most recently seen; drop the oldest past the bound
        (with what it had not saved yet: KV then lacks it, as after a lost keyframe)."""
        self._nodes.pop(node, None)
        self._nodes[node] = facts
        while len(self._nodes) > self.max_nodes:
            oldest = next(iter(self._nodes))
            del self._nodes[oldest]
            self._unsaved.pop(oldest, None)

    # --- KV -----------------------------------------------------------------------

    def unsaved(self, node: str) -> bool:
        """Whether `node`'s facts were learnt here and are not yet in KV."""
        return node in self._unsaved

    async def save(self, node: str) -> None:
        """Write `node`'s facts learnt here to KV (the intake does, before it handles the
        sample that carried them), unless KV holds facts from a later sample (a replica
        that took the partition over learnt them). When KV fails they stay for the
        node's next sample: the sample is decoded all the same, and losing the KV copy
        costs a takeover one keyframe interval, not a sample."""
        held = self._unsaved.pop(node, None)
        if held is None or self.kv is None:
            return
        value, at = held
        try:
            for _ in range(3):  # compare-and-set: another writer in between, look again
                entry = await self.kv.get(kv_key(node))
                if entry is not None and _at(entry.value) > at:
                    return
                if await self.kv.cas(kv_key(node), value, entry.revision if entry else 0):
                    return
        except BaseException:
            self._unsaved.setdefault(node, held)  # unless newer facts came meanwhile
            raise
        self._unsaved.setdefault(node, held)  # lost every try: the node's next sample again

    def forget_misses(self, nodes: frozenset[str] | set[str]) -> None:
        """Ask KV again at these nodes' next samples: their partition moved (another
        replica may have learnt and saved their facts meanwhile)."""
        for node in nodes:
            self._missed.pop(node, None)

    async def load(self, node: str, wanted: str, at: float) -> bool:
        """Read `node`'s facts from KV; False when they are not the `wanted` ones (none,
        others, or not decodable). A miss is remembered for MISS_TTL_S of the samples'
        time: the node's next samples do not ask KV again meanwhile."""
        missed = self._missed.get(node)
        if self.kv is None or (missed and missed[0] == wanted and at - missed[1] < MISS_TTL_S):
            return False
        entry = await self.kv.get(kv_key(node))
        facts = None if entry is None else _kept(node, entry.value)
        if facts is None or facts.id != wanted:
            self._missed.pop(node, None)
            self._missed[node] = (wanted, at)
            while len(self._missed) > self.max_nodes:
                del self._missed[next(iter(self._missed))]
            return False
        self._touch(node, facts)
        return True


def _joined(doc: wire.Compact, json: bool, known: NodeFacts, publisher: str) -> Telemetry:
    """A sample's arrays joined to its node's facts."""
    if isinstance(doc.gpus, msgspec.Raw):
        try:
            rows = known.rows.decode(doc.gpus, json)
        except msgspec.DecodeError as exc:
            raise EventError("schema", f"telemetry v2 gpus: {exc}") from exc
    else:  # read whole (`FactsBook.read`), in the order of these facts
        rows = typing.cast(list[tuple[Any, ...]], doc.gpus)
    templates = known.templates
    if len(rows) != len(templates):
        raise EventError(
            "schema", f"telemetry v2: {len(rows)} GPU arrays for {len(templates)} GPUs' facts"
        )
    facts = known.rows.facts(templates, rows)
    if known.labels:
        for fact in facts:
            if fact["labels"] is not None:
                fact["labels"] = dict(fact["labels"])  # each sample its own, as from v1
    with_medians(facts)
    return Telemetry(doc.id, doc.node, doc.ts, doc.source, facts, publisher=publisher)


def _at(value: bytes) -> float:
    """When the facts KV holds were learnt (0 when they do not decode: replace them)."""
    try:
        return wire.read_kept(value).at
    except msgspec.DecodeError:
        return 0.0


def _kept(node: str, value: bytes) -> NodeFacts | None:
    try:
        kept = wire.read_kept(value)
        return _node_facts(node, kept.facts, kept.static)
    except (msgspec.DecodeError, EventError) as exc:
        log.warning("static facts of %s in KV do not decode: %s", node, exc)
        return None


def _hashed(fid: str, static: wire.Static) -> None:
    """EventError ("schema") unless `fid` is the hash of `static`."""
    if wire.facts_id(static) != fid:
        raise EventError("schema", f"telemetry v2: facts {fid} is not the hash of its static")


def _node_facts(node: str, fid: str, static: wire.Static) -> NodeFacts:
    """Check a keyframe's facts and build the templates (every model field, then what
    the matcher adds: `node`, `gpu`, the medians, as v1's facts have them); EventError
    ("schema") when bad."""
    _hashed(fid, static)
    fields = tuple(static.fields)
    try:
        rows = wire.rows(fields)
    except ValueError as exc:
        raise EventError("schema", f"telemetry v2 static.fields: {exc}") from exc
    named = set(fields)
    for i, gpu in enumerate(static.gpus):
        both = sorted(named.intersection(gpu))
        if both:
            raise EventError("schema", f"telemetry v2 static.gpus.{i}: {both[0]} is also in fields")
    try:
        templates = gpu_facts(static.gpus, node)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(map(str, first["loc"]))
        raise EventError("schema", f"telemetry v2 static.gpus.{where}: {first['msg']}") from exc
    labels = any(t["labels"] is not None for t in templates)
    return NodeFacts(fid, rows, tuple(templates), labels)
