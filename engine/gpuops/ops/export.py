"""`gpuops export`: events from JetStream as JSON lines, the format `replay` and `publish` read.

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

from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from gpuops.bus.conn import EVENTS, TELEMETRY
from gpuops.clock import Clock
from gpuops.errors import BusError, ConfigError
from gpuops.match.durations import parse_duration
from gpuops.subjects import stored_event_at, stored_telemetry_at, token

# A bounded read never waits this long for the next message; longer means a stalled server.
_STALL_S = 30.0


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

    @property
    def total(self) -> int:
        """Lines written."""
        return sum(self.lines.values())


async def export(js: JetStreamContext, selection: Selection, out: IO[bytes]) -> Exported:
    """Write the selected events to `out`, one JSON object per line, in stored order."""
    done = Exported()
    readers = [_read(js, s, subjects, selection) for s, subjects in selection.filters().items()]
    async for stream, payload in _merge(readers):
        line = _one_line(payload)
        if line is None:
            done.skipped += 1
            continue
        out.write(line + b"\n")
        done.lines[stream] = done.lines.get(stream, 0) + 1
    return done


def _one_line(payload: bytes) -> bytes | None:
    """The payload as one line: re-encoded if it spans lines, None if that is impossible."""
    line = payload.strip()
    if b"\n" not in line and b"\r" not in line:
        return line or None
    try:
        return json.dumps(json.loads(line), separators=(",", ":")).encode()
    except ValueError:
        return None


async def _read(
    js: JetStreamContext, stream: str, subjects: list[str], selection: Selection
) -> AsyncGenerator[tuple[float, str, bytes], None]:
    """(stored at, stream, payload) of each selected message, up to the stream's end now."""
    last = await _last_seq(js, stream)
    if last == 0:
        return
    sub = await js.subscribe(
        subjects[0], stream=stream, ordered_consumer=True, config=_config(subjects, selection)
    )
    try:
        info = await sub.consumer_info()
        if info.num_pending == 0 and not (info.delivered and info.delivered.consumer_seq):
            return
        while True:
            try:
                msg = await sub.next_msg(timeout=_STALL_S)
            except (TimeoutError, NatsTimeout) as exc:
                raise BusError(f"export from {stream} stalled: no message in {_STALL_S}s") from exc
            meta = msg.metadata
            stored = meta.timestamp.timestamp() if meta.timestamp else 0.0
            if meta.sequence.stream > last or _after(stored, selection.until):
                return
            yield stored, stream, msg.data
            if meta.sequence.stream == last or not meta.num_pending:
                return
    finally:
        await sub.unsubscribe()


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
    readers: list[AsyncGenerator[tuple[float, str, bytes], None]],
) -> AsyncIterator[tuple[str, bytes]]:
    """The readers' messages in stored order (each reader is in order already)."""
    heads: list[tuple[float, int, str, bytes]] = []
    try:
        for index, reader in enumerate(readers):
            await _push(heads, index, reader)
        while heads:
            _, index, stream, payload = heapq.heappop(heads)
            yield stream, payload
            await _push(heads, index, readers[index])
    finally:
        # A reader left half-read (an error, a closed output) removes its consumer now.
        for reader in readers:
            await reader.aclose()


async def _push(
    heads: list[tuple[float, int, str, bytes]],
    index: int,
    reader: AsyncIterator[tuple[float, str, bytes]],
) -> None:
    try:
        stored, stream, payload = await anext(reader)
    except StopAsyncIteration:
        return
    heapq.heappush(heads, (stored, index, stream, payload))
