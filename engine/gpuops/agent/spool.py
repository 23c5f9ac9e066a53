"""An on-disk spool for health events while NATS is unreachable: bounded, in order.

When full, the oldest events are dropped and counted (the count survives restarts and
is reported on the next heartbeat). Telemetry never comes here: the next sample
replaces a lost one.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Spooled:
    """One held event: where it goes and its id for dedup on the server."""

    subject: str
    payload: str
    msg_id: str


class Spool:
    """A JSON-lines file of events waiting to be published."""

    def __init__(self, path: Path, max_events: int = 10_000) -> None:
        self.path = path
        self.max_events = max_events
        path.parent.mkdir(parents=True, exist_ok=True)
        self._dropped_path = path.with_suffix(".dropped")

    @property
    def dropped(self) -> int:
        """Events dropped because the spool was full."""
        try:
            return int(self._dropped_path.read_text())
        except (OSError, ValueError):
            return 0

    def __len__(self) -> int:
        return len(self._read())

    def push(self, item: Spooled) -> None:
        """Keep one event; drop the oldest when full."""
        items = [*self._read(), item]
        over = len(items) - self.max_events
        if over > 0:
            items = items[over:]
            self._dropped_path.write_text(str(self.dropped + over))
        self._write(items)

    def pending(self) -> list[Spooled]:
        """Held events, oldest first."""
        return self._read()

    def commit(self, n: int) -> None:
        """Forget the first `n` events (they were published)."""
        self._write(self._read()[n:])

    async def flush(self, send: Callable[[Spooled], Awaitable[bool]]) -> bool:
        """Send held events in order, stopping at the first that fails (NATS is still
        away); True when none is left."""
        pending = self.pending()
        done = 0
        for item in pending:
            if not await send(item):
                break
            done += 1
        if done:
            self.commit(done)
            log.info("flushed %d spooled events", done)
        return done == len(pending)

    def _read(self) -> list[Spooled]:
        if not self.path.exists():
            return []
        return [Spooled(**json.loads(line)) for line in self.path.read_text().splitlines() if line]

    def _write(self, items: list[Spooled]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(
            "".join(
                json.dumps({"subject": i.subject, "payload": i.payload, "msg_id": i.msg_id}) + "\n"
                for i in items
            )
        )
        os.replace(tmp, self.path)
