"""The engine's heartbeat in the control bucket, and what `status` makes of it.

A running engine writes `heartbeat.<role>` every few seconds (its start time, version,
rule and host counts, whether it was started in dry-run, its inventory file), and once
more with `stopped` set when it stops cleanly. Whether
an engine runs is then a question anyone who can read the bucket can answer; an engine
killed outright just stops beating, and its last beat ages.

A beat's age is wall time on both sides (`wall`): the beat loop waits wall seconds, and
an engine on a scaled clock (the demo's) would otherwise look gone between two beats.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict

from gpuops.bus.store import KV, Store
from gpuops.clock import rfc3339

EVERY_S = 5.0
# Three missed beats: a loaded engine is late, not gone.
STALE_AFTER_S = 3 * EVERY_S + 1.0
# Roles whose loops decide: an executor alone runs intents but answers no event.
DECIDING = ("all", "engine")


class Heartbeat(BaseModel):
    """One engine's latest beat."""

    model_config = ConfigDict(frozen=True)

    role: str
    started: float
    at: float
    version: str
    rules: int
    hosts: int
    host: str = ""
    pid: int = 0
    stopped: float | None = None
    # Wall-clock seconds at the beat (`at` is the engine's clock, which may be scaled).
    wall: float = 0.0
    # Started with --dry-run (settings `dry_run`): every decision is a dry run, whatever
    # the switch in KV says.
    dry_run: bool = False
    inventory: str = ""  # the inventory file it runs with ("" before this field existed)
    # The records this engine found unreadable (gpuops.record.unreadable), as lines.
    unreadable: tuple[str, ...] = ()


def this_process(
    role: str,
    started: float,
    rules: int,
    hosts: int,
    *,
    dry_run: bool = False,
    inventory: str = "",
) -> Heartbeat:
    """A beat of this process, dated at its start."""
    from gpuops import __version__

    return Heartbeat(
        role=role,
        started=started,
        at=started,
        wall=time.time(),
        version=__version__,
        rules=rules,
        hosts=hosts,
        host=socket.gethostname(),
        pid=os.getpid(),
        dry_run=dry_run,
        inventory=inventory,
    )


class Heartbeats:
    """Beats in the control bucket under `heartbeat.<role>`."""

    def __init__(self, kv: KV) -> None:
        self.store: Store[Heartbeat] = Store(kv, Heartbeat, "heartbeat")

    async def beat(self, beat: Heartbeat) -> None:
        """Store the latest beat of its role."""
        await self.store.put(beat, beat.role)

    async def all(self) -> list[Heartbeat]:
        """Every role's latest beat that reads, newest first (an engine whose beat does
        not decode reads as not beating)."""
        found, _ = await self.store.readable()
        return sorted((b for _, b in found), key=lambda b: -b.at)


@dataclass(frozen=True, slots=True)
class EngineState:
    """Whether an engine that decides is running, in one line, and the beat it rests on."""

    running: bool
    line: str
    beat: Heartbeat | None


def engine_state(beats: list[Heartbeat], now: float, wall: float | None = None) -> EngineState:
    """Up when a deciding role beat within STALE_AFTER_S and has not stopped: aged in
    wall seconds where the beat and the caller both have them (`wall`), else on `now`."""
    deciding = [b for b in beats if b.role in DECIDING]
    if not deciding:
        return EngineState(False, "no engine running (no heartbeat on this NATS)", None)
    beat = max(deciding, key=lambda b: b.at)
    since = (wall - beat.wall) if wall is not None and beat.wall > 0.0 else (now - beat.at)
    age = max(since, 0.0)
    if beat.stopped is None and age <= STALE_AFTER_S:
        line = (
            f"engine up since {rfc3339(beat.started)[:19]} (version {beat.version}, "
            f"{beat.rules} rules, {beat.hosts} hosts, role {beat.role}, {beat.host} pid {beat.pid})"
        )
        return EngineState(True, line, beat)
    how = "stopped" if beat.stopped is not None else "last heartbeat"
    return EngineState(False, f"no engine running ({how} {age:.0f} s ago)", beat)
