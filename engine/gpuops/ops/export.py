"""`gpuops export`: events from JetStream as JSON lines, the format `replay` and `publish` read.

Telemetry is written in one format, v2 (compact, the default) or v1, whichever format
each sample was published in (gpuops.bus.wire.Expander).

Each stream (health events, telemetry) is read by an ephemeral ordered consumer that
starts at `since` (the time the stream stored a message) and stops at the end of the
stream as it was when the export began, or at `until`: an export of a busy stream ends.
The two streams are merged in the order they stored their messages.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import IO

import msgspec
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import BucketNotFoundError, KeyDeletedError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from gpuops.bus.buckets import BUCKETS, FACTS_KEY
from gpuops.bus.conn import EVENTS, TELEMETRY
from gpuops.bus.reader import slot_read
from gpuops.bus.store import kv_key
from gpuops.bus.wire import V2, Expander, Kept, is_v2, read, read_kept
from gpuops.clock import Clock
from gpuops.errors import BusError, ConfigError
from gpuops.match.durations import parse_duration
from gpuops.subjects import stored_event_at, stored_telemetry_at, token

# A bounded read never waits this long for the next message; longer means a stalled server.
_STALL_S = 30.0
_BATCH = 512


def parse_time(text: str, clock: Clock) -> datetime:
    """`2h` (that long before now) or an ISO 8601 time (UTC unless it names a zone)."""
    try:
        return datetime.fromtimestamp(clock.now() - parse_duration(text), tz=UTC)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ConfigError(
            f"bad time {text!r}: use a duration before now (30m, 2h, 7d) "
            "or an ISO time (2027-01-15T08:00:00Z)"
        ) from None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class Selection:
    """Which events: stored within [since, until], of these nodes and kinds (empty: all)."""

    since: datetime | None = None
    until: datetime | None = None
    nodes: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()

    def filters(self) -> dict[str, list[str]]:
        """The subjects to read, per stream; a stream with none is not read."""
        nodes = [token(n) for n in self.nodes] or ["*"]
        out: dict[str, list[str]] = {}
        if not self.kinds or "telemetry" in self.kinds:
            out[TELEMETRY] = [stored_telemetry_at("*", n) for n in nodes]  # any partition
        kinds = [token(k) for k in self.kinds if k != "telemetry"]
        if kinds or not self.kinds:
            out[EVENTS] = [stored_event_at("*", k, n) for k in kinds or ["*"] for n in nodes]
        return out


@dataclass(slots=True)
class Exported:
    """Counts of what was written, per stream."""

    lines: dict[str, int] = field(default_factory=dict)
    skipped: int = 0
    unjoined: int = 0  # v2 samples whose static facts neither the stream nor KV had

    @property
    def total(self) -> int:
        """Lines written."""
        return sum(self.lines.values())


async def export(
    js: JetStreamContext, selection: Selection, out: IO[bytes], telemetry_format: int = V2
) -> Exported:
    """Write the selected events to `out`, one JSON object per line, in stored order;
    telemetry in format `telemetry_format` whichever format each sample came in (a v2
    sample whose keyframe came before the selection joined to the facts in KV)."""
    done = Exported()
    expander = Expander(telemetry_format)
    facts = _Facts(js)
    readers = [_read(js, s, subjects, selection) for s, subjects in selection.filters().items()]
    async for stream, payload, subject in _merge(readers):
        if stream == TELEMETRY:
            line = await _telemetry_line(expander, facts, payload, subject.rsplit(".", 1)[-1])
        else:
            line = _one_line(payload)
        if line is None:
            done.skipped += 1
            continue
        out.write(line + b"\n")
        done.lines[stream] = done.lines.get(stream, 0) + 1
    done.unjoined = expander.unjoined
    return done


async def _telemetry_line(
    expander: Expander, facts: _Facts, payload: bytes, node_token: str
) -> bytes | None:
    try:
        payload = payload.strip()
        doc = read(payload) if is_v2(payload) else None
        if doc is not None and expander.needs(doc):
            kept = await facts.get(doc.node)
            if kept is not None:
                expander.learn(doc.node, kept)
        line = expander.line(payload, doc, node_token)
    except (msgspec.DecodeError, KeyError, TypeError, ValueError, AttributeError):
        return None  # as an unreadable v1 line is: counted, left out
    return None if line is None else _one_line(line)


class _Facts:
    """The engine's copy of nodes' static facts (KV), opened at the first need."""

    def __init__(self, js: JetStreamContext) -> None:
        self.js = js
        self._kv: KeyValue | None = None
        self._none = False

    async def get(self, node: str) -> Kept | None:
        if self._none:
            return None
        try:
            if self._kv is None:
                self._kv = await self.js.key_value(BUCKETS[FACTS_KEY].bucket)
            entry = await self._kv.get(kv_key(node))
        except (BucketNotFoundError, NotFoundError, KeyNotFoundError, KeyDeletedError):
            return None
        except NatsError:
            self._none = True  # the bucket is not readable: the stream's keyframes only
            return None
        try:
            return read_kept(entry.value) if entry.value else None
        except msgspec.DecodeError:
            return None


def _one_line(payload: bytes) -> bytes | None:
    """The payload as one line: re-encoded if it spans lines, None if that is impossible."""
    line = payload.strip()
    if b"\n" not in line and b"\r" not in line:
        return line or None
    try:
        return json.dumps(json.loads(line), separators=(",", ":")).encode()
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return None


async def _read(
    js: JetStreamContext, stream: str, subjects: list[str], selection: Selection
) -> AsyncGenerator[tuple[float, str, bytes, str], None]:
    """(stored at, stream, payload) of each selected message, up to the stream's end now."""
    last = await _last_seq(js, stream)
    if last == 0:
        return
    # A consumer of one of the readers' own names: the export's user may make no other
    # on the streams the engine consumes (gpuops.bus.reader).
    async with slot_read(js, subjects[0], stream, _config(subjects, selection)) as sub:
        info = await sub.consumer_info()
        if not info.num_pending:
            return
        while True:
            for msg in await _next_batch(sub, stream):
                meta = msg.metadata
                stored = meta.timestamp.timestamp() if meta.timestamp else 0.0
                if meta.sequence.stream > last or _after(stored, selection.until):
                    return
                yield stored, stream, msg.data, msg.subject
                if meta.sequence.stream == last or not meta.num_pending:
                    return


async def _next_batch(sub: JetStreamContext.PullSubscription, stream: str) -> list[Msg]:
    try:
        return await sub.fetch(_BATCH, timeout=_STALL_S)
    except (TimeoutError, NatsTimeout) as exc:
        raise BusError(f"export from {stream} stalled: no message in {_STALL_S}s") from exc
    except NatsError as exc:  # the consumer deleted under it, the server gone
        raise BusError(f"export from {stream} cut short: {type(exc).__name__}: {exc}") from exc


async def _last_seq(js: JetStreamContext, stream: str) -> int:
    try:
        info = await js.stream_info(stream)
    except NotFoundError:
        return 0
    return int(info.state.last_seq) if info.state.messages else 0


def _config(subjects: list[str], selection: Selection) -> ConsumerConfig:
    many = subjects if len(subjects) > 1 else None
    if selection.since is None:
        return ConsumerConfig(deliver_policy=DeliverPolicy.ALL, filter_subjects=many)
    return ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_TIME,
        opt_start_time=selection.since,
        filter_subjects=many,
    )


def _after(stored: float, until: datetime | None) -> bool:
    return until is not None and stored > until.timestamp()


async def _merge(
    readers: list[AsyncGenerator[tuple[float, str, bytes, str], None]],
) -> AsyncIterator[tuple[str, bytes, str]]:
    """The readers' messages in stored order (each reader is in order already)."""
    heads: list[tuple[float, int, str, bytes, str]] = []
    try:
        for index, reader in enumerate(readers):
            await _push(heads, index, reader)
        while heads:
            _, index, stream, payload, subject = heapq.heappop(heads)
            yield stream, payload, subject
            await _push(heads, index, readers[index])
    finally:
        # A reader left half-read (an error, a closed output) removes its consumer now.
        for reader in readers:
            await reader.aclose()


async def _push(
    heads: list[tuple[float, int, str, bytes, str]],
    index: int,
    reader: AsyncIterator[tuple[float, str, bytes, str]],
) -> None:
    try:
        stored, stream, payload, subject = await anext(reader)
    except StopAsyncIteration:
        return
    heapq.heappush(heads, (stored, index, stream, payload, subject))
