"""`gpuops run --replicas N`: N engine replicas from one command, on one machine.

One Python process decides on one core; a machine with more cores runs several replicas,
each a process of its own that shares the partitions with the others through their
leases (exactly as replicas on several machines do). The first replica keeps the role
asked for (with `all`, the executor runs there too) and starts the embedded nats-server
when no URL is given; the others are `--role engine` and join it. A replica that dies is
started again after a backoff; SIGINT/SIGTERM stop them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

from gpuops.bus.embedded import url_file

log = logging.getLogger(__name__)

BACKOFF_MAX_S = 30.0
STOP_WAIT_S = 30.0
# The first replica's embedded server has this long to write its URL before the others start.
FIRST_READY_S = 120.0


@dataclass
class Child:
    """One replica process."""

    name: str
    argv: list[str]
    env: dict[str, str]
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0


@dataclass
class Supervisor:
    """Starts, watches and stops the replica processes."""

    children: list[Child]
    state_dir: Path
    embedded: bool
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> int:
        """Run until a signal; the exit status is the first child's last one."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stop.set)
        first, *rest = self.children
        watchers = [asyncio.create_task(self._keep(first))]
        if self.embedded and rest:
            await self._first_ready()
        watchers += [asyncio.create_task(self._keep(c)) for c in rest]
        await self.stop.wait()
        await asyncio.gather(*(self._stop(c) for c in self.children))
        await asyncio.gather(*watchers, return_exceptions=True)
        return first.proc.returncode or 0 if first.proc else 0

    async def _first_ready(self) -> None:
        """Wait until the first replica's embedded server says where it is."""
        marker = url_file(self.state_dir)
        deadline = asyncio.get_running_loop().time() + FIRST_READY_S
        while not marker.exists() and asyncio.get_running_loop().time() < deadline:
            if self.stop.is_set():
                return
            await asyncio.sleep(0.2)

    async def _keep(self, child: Child) -> None:
        delay = 1.0
        while not self.stop.is_set():
            child.proc = await asyncio.create_subprocess_exec(*child.argv, env=child.env)
            log.info("replica %s started (pid %d)", child.name, child.proc.pid)
            code = await child.proc.wait()
            if self.stop.is_set():
                return
            child.restarts += 1
            log.warning("replica %s exited with %s; starting it in %.0fs", child.name, code, delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), delay)
            delay = min(delay * 2, BACKOFF_MAX_S)

    async def _stop(self, child: Child) -> None:
        proc = child.proc
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()  # a clean stop gives its partitions back at once
        try:
            await asyncio.wait_for(proc.wait(), STOP_WAIT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()


def replica_children(args: list[str], replicas: int, base_id: str, role: str) -> list[Child]:
    """The command line of each replica: this command's, without --replicas, with its id."""
    children = []
    for i in range(replicas):
        env = {**os.environ, "GPUOPS_REPLICA_ID": f"{base_id}-{i}"}
        own_role = role if i == 0 else "engine"
        argv = [sys.executable, "-m", "gpuops.cli", *args, "--role", own_role]
        children.append(Child(f"{base_id}-{i}", argv, env))
    return children


def strip_option(argv: list[str], *names: str) -> list[str]:
    """argv without the given options and their values (`--x v` and `--x=v`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in names:
            skip = True
            continue
        if any(arg.startswith(f"{n}=") for n in names):
            continue
        out.append(arg)
    return out
