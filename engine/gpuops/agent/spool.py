"""An on-disk spool for health events while NATS is unreachable: bounded, in order.

The events are held in memory and written through to a JSON-lines file, so they outlive
a restart. The file never stops the agent: a line that does not read (a torn write) is
skipped and counted as dropped, and a write that fails (disk full, read-only) leaves the
events in memory, still bounded, until a later write succeeds. Each write is fsynced
before it replaces the file, so a power cut leaves the old file or the new, whole.
When full, events are dropped and counted (the count survives restarts and is reported
on the next heartbeat): replaceable ones first (a passing scheduled probe), then the
oldest. Telemetry and heartbeats never come here: the next one replaces a lost one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FIELDS = ("subject", "payload", "msg_id")


@dataclass(frozen=True, slots=True)
class Spooled:
    """One held event: where it goes and its id for dedup on the server."""

    subject: str
    payload: str
    msg_id: str
    replaceable: bool = False  # a full spool drops these first (a passing scheduled probe)


class Spool:
    """Events waiting to be published, in memory and in a JSON-lines file."""

    def __init__(self, path: Path, max_events: int = 10_000) -> None:
        self.path = path
        self.max_events = max_events
        self._dropped_path = path.with_suffix(".dropped")
        self.unreadable = 0  # lines of the file that did not read, skipped at start
        self.write_failures = 0  # writes that failed; their events stayed in memory
        self._failing = False  # the last write failed: say so once, and when it mends
        self._sending: Spooled | None = None  # the event a flush awaits the ack of
        with contextlib.suppress(OSError):  # an unusable place is told by the first write
            path.parent.mkdir(parents=True, exist_ok=True)
        self._dropped = _read_count(self._dropped_path)
        self._items = self._load()

    @property
    def dropped(self) -> int:
        """Events lost: dropped because the spool was full, or unreadable in its file."""
        return self._dropped

    def __len__(self) -> int:
        return len(self._items)

    def push(self, item: Spooled) -> None:
        """Keep one event; when full, drop one: a replaceable one, else the oldest."""
        self._items.append(item)
        over = len(self._items) - self.max_events
        if over > 0:
            self._drop(over)
        self._save()

    def _drop(self, n: int) -> None:
        """Drop `n` events: replaceable ones first, then the oldest. Never the one a flush
        is sending: it may yet be acked."""
        held = [i for i in self._items if i is not self._sending]
        victims = [i for i in held if i.replaceable][:n]
        victims += [i for i in held if not i.replaceable][: n - len(victims)]
        gone = {id(i) for i in victims}
        self._items = [i for i in self._items if id(i) not in gone]
        self._count_dropped(len(victims))

    def pending(self) -> list[Spooled]:
        """Held events, oldest first."""
        return list(self._items)

    async def flush(self, send: Callable[[Spooled], Awaitable[bool]]) -> bool:
        """Send held events in order, stopping at the first that fails (NATS is still
        away); True when every one it tried went out.

        Events may be pushed (and the oldest dropped) while a send awaits its ack, so
        each event sent is forgotten by itself, never by its place in the spool.
        """
        done, ok = 0, True
        for item in self.pending():
            if item not in self._items:
                continue  # dropped while an earlier one was sent, unsent (counted then)
            ok = await self._send_one(send, item)
            if not ok:
                break
            with contextlib.suppress(ValueError):  # another flush may have sent it too
                self._items.remove(item)
            done += 1
        if done:
            self._save()
            log.info("flushed %d spooled events", done)
        return ok

    async def _send_one(self, send: Callable[[Spooled], Awaitable[bool]], item: Spooled) -> bool:
        self._sending = item
        try:
            return await send(item)
        finally:
            self._sending = None

    def _load(self) -> list[Spooled]:
        """The events the file holds; a line that does not read is skipped and counted."""
        try:
            lines = self.path.read_bytes().splitlines()
        except FileNotFoundError:
            return []
        except OSError as exc:  # e.g. a directory in its place: start empty, go on
            log.warning("spool %s unreadable (%s): starting empty", self.path, exc)
            return []
        items = [item for item in map(_parse, lines) if item is not None]
        bad = sum(1 for line in lines if line.strip()) - len(items)
        if bad:
            self.unreadable = bad
            self._count_dropped(bad)
            log.warning(
                "spool %s: %d lines did not read (a torn write?); skipped, %d events kept",
                self.path,
                bad,
                len(items),
            )
        return items

    def _save(self) -> None:
        """Write the held events through; when that fails they stay in memory."""
        data = b"".join(_line(item) for item in self._items)
        try:
            _replace(self.path, data)
        except OSError as exc:
            self.write_failures += 1
            if not self._failing:
                log.warning(
                    "spool %s not writable (%s): events held in memory (at most %d) until it is",
                    self.path,
                    exc,
                    self.max_events,
                )
            self._failing = True
            return
        if self._failing:
            log.info("spool %s writable again: %d events written", self.path, len(self._items))
        self._failing = False

    def _count_dropped(self, n: int) -> None:
        self._dropped += n
        try:  # the count is reported on heartbeats; losing it must not lose the events
            _replace(self._dropped_path, str(self._dropped).encode())
        except OSError as exc:
            log.warning("spool drop count not saved to %s (%s)", self._dropped_path, exc)


def _parse(line: bytes) -> Spooled | None:
    try:
        raw = json.loads(line)
    except ValueError:  # not JSON, or not UTF-8
        return None
    if not isinstance(raw, dict):
        return None
    subject, payload, msg_id = (raw.get(k) for k in FIELDS)
    if not (isinstance(subject, str) and isinstance(payload, str) and isinstance(msg_id, str)):
        return None
    return Spooled(subject, payload, msg_id, raw.get("replaceable") is True)


def _line(item: Spooled) -> bytes:
    raw: dict[str, Any] = {"subject": item.subject, "payload": item.payload, "msg_id": item.msg_id}
    if item.replaceable:
        raw["replaceable"] = True
    return json.dumps(raw).encode() + b"\n"


def _replace(path: Path, data: bytes) -> None:
    """Put `data` at `path` whole or not at all, and durably: the temporary file is fsynced
    before the rename and the directory after it, so a power cut cannot tear a line."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_count(path: Path) -> int:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return 0
