"""`gpuops replay`: a JSON-lines file of recorded events through the shadow engine.

The engine is the live one (`Shadow`, built by `build_engine`) under the site's
settings, and each line meets the live intake's checks first: what does not decode is
refused by reason, and an event dated more than `max_future_skew_s` after the replay's
clock is refused as `future`, as the intake would have dead-lettered it. The clock is
the recording's own time: the latest event fed so far, or, when the events just after
this one are later still (the recording resumes after a quiet hour), the earliest of
those, since the live engine's clock had reached them by the time they came. So one
event dated a year ahead neither moves the clock nor makes every `absent` rule fire,
and a gap in the recording is not mistaken for a future date. Events older than
`stale_after_s` against that clock are stale, as live.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from pathlib import Path

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gpuops.bus import wire
from gpuops.errors import EventError
from gpuops.intake.compact import FactsBook
from gpuops.intake.decode import check_future, decode
from gpuops.inventory.hosts import load_inventory
from gpuops.match.facts import Telemetry
from gpuops.match.rules import RuleSet
from gpuops.models import NODE_PATTERN, Event, Reason
from gpuops.settings import Settings
from gpuops.spine.report import Report
from gpuops.spine.shadow import Shadow, WouldRun

# Events read ahead of the one judged: the earliest of them bounds the live clock when
# it came (an agent's clock a year ahead among a fleet's honest samples is outvoted).
LOOKAHEAD = 8


class _Unjoined(msgspec.Struct, frozen=True):
    """A telemetry v2 sample read to its envelope: joined to its node's static facts once
    its time is judged, as the intake joins it (a keyframe refused as `future` teaches
    the book nothing live, so not here either)."""

    doc: wire.Compact
    json: bool

    @property
    def epoch(self) -> float:  # what the lookahead reads of the events after one
        return self.doc.epoch


Read = Event | Telemetry | _Unjoined


async def replay_file(
    path: Path, rules: RuleSet, inventory: Path | None, settings: Settings | None = None
) -> tuple[list[WouldRun], dict[str, int]]:
    """Would-be actions, in event order, and counts of events fed and refused."""
    _, report = await replay(path, rules, inventory, settings)
    return report.actions, {"events": report.events, "bad": report.refusals()}


async def replay(
    path: Path, rules: RuleSet, inventory: Path | None, settings: Settings | None = None
) -> tuple[Shadow, Report]:
    """The shadow engine after the recording, and the report of what it did."""
    settings = settings or Settings()
    shadow = _shadow(path, rules, inventory, settings)
    # As the engine's: the facts of a node the inventory lacks are joined, not kept.
    book = FactsBook(known=shadow.hosts.__contains__ if inventory is not None else None)
    report = Report()
    ahead: deque[tuple[int, Read]] = deque()
    for number, read in _lines(path, book):
        if isinstance(read, EventError):
            report.refuse(number, read.reason, read.message)
            continue
        ahead.append((number, read))
        if len(ahead) > LOOKAHEAD:
            await _judge(shadow, report, ahead, settings.max_future_skew_s, book)
    while ahead:
        await _judge(shadow, report, ahead, settings.max_future_skew_s, book)
    report.unapplied = shadow.unapplied
    return shadow, report


async def _judge(
    shadow: Shadow,
    report: Report,
    ahead: deque[tuple[int, Read]],
    max_future_s: float,
    book: FactsBook,
) -> None:
    """The first event read ahead: refused as the intake would, or fed to the engine."""
    number, read = ahead.popleft()
    dated = read.doc if isinstance(read, _Unjoined) else read
    later = min((e.epoch for _, e in ahead), default=None)
    known = [t for t in (shadow.now, later) if t is not None]
    try:
        if known:
            check_future(dated, max(known), max_future_s)
        event = book.join(read.doc, read.json) if isinstance(read, _Unjoined) else read
    except EventError as exc:
        report.refuse(number, exc.reason, exc.message, dated.node)
        return
    report.events += 1
    if event.node not in shadow.hosts:
        report.unknown[event.node] += 1
    decisions = await shadow.feed(event)
    report.decided(decisions)
    if any(d.reason is Reason.BREAKER_OPEN for d in decisions):
        record, _ = await shadow.engine.breaker.get()
        report.breaker(record)


def _shadow(path: Path, rules: RuleSet, inventory: Path | None, settings: Settings) -> Shadow:
    """The live engine over the inventory (its groups and variables too); with none,
    every node the recording names is taken as known."""
    if inventory is None:
        return Shadow(rules, _nodes_in(path), settings)
    inv = load_inventory(inventory)
    return Shadow(rules, inv.hosts, settings, hostvars=inv.hostvars, groups=inv.groups)


def _lines(path: Path, book: FactsBook) -> Iterator[tuple[int, Read | EventError]]:
    """Each non-blank line's number and its event, or why the intake refuses it: a v2
    sample read to its envelope in `book` (joined to its node's static facts once its
    time is judged)."""
    with path.open("rb") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                if wire.is_v2(line):
                    yield number, _Unjoined(book.read(line), not wire.is_msgpack(line))
                else:
                    yield number, decode(line)
            except EventError as exc:
                yield number, exc


class _NodeOnly(BaseModel):
    """What the first pass reads of a v1 event: its node (pydantic-core parses the JSON
    and builds nothing else, a sixth of a full decode). The parser is the v1 feed's own,
    so the pass takes what the feed takes: msgspec, faster, refuses the NaN an event's open
    fields may hold, passes invalid UTF-8 in fields it skips, and nesting too deep for it
    raises RecursionError (each would name a node the feed does not, or miss one)."""

    model_config = ConfigDict(extra="ignore")
    node: str = Field(pattern=NODE_PATTERN)


def _nodes_in(path: Path) -> set[str]:
    """Every node the recording names, without decoding its events: those are decoded
    once, as they are fed (a line that does not decode is refused then, by reason). Each
    line's node is read by the parser the feed reads that line with: pydantic-core for
    v1, msgspec for a v2 sample (half pydantic-core's cost for the node alone)."""
    out: set[str] = set()
    with path.open("rb") as lines:
        for line in lines:
            try:
                v2 = wire.is_v2(line)
                out.add(wire.node_of(line) if v2 else _NodeOnly.model_validate_json(line).node)
            except (ValidationError, msgspec.DecodeError):
                continue
    return out
