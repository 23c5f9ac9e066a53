"""The processes of `gpuops bench fleet`: fleet publishers, engine replicas, and what
the bench reads of them (/metrics, /proc).

A publisher plays the agents of a slice of the simulated fleet: every node once per
second, spread over the second, by core NATS publish as the agent does. Building a
sample from the fleet's H200 recording costs ~0.8 ms of CPU (12,500 nodes would need
ten cores for that alone), so each node's sample is built once before the clock starts
and rebuilt round-robin every `refresh_s`; in between the node's last sample goes out
again under a new id and the current time. A chunk of nodes more than a whole second
behind its slot is not sent (an agent's next sample replaces it) and is counted as
missed, so a publisher that cannot keep up shows as such instead of stretching time.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import IO, Any, TypeVar

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gpuops import subjects
from gpuops.bench.fleet.figures import BenchError
from gpuops.bus.client import servers
from gpuops.bus.identity import KeyRing
from gpuops.bus.wire import TelemetryWriter
from gpuops.clock import rfc3339
from gpuops.sim.fleet import SimFleet

# Nodes of one publisher are sent in this many chunks a second (one every 20 ms).
CHUNKS_PER_S = 50
T = TypeVar("T")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_KB = os.sysconf("SC_PAGE_SIZE") // 1024


@dataclass(frozen=True, slots=True)
class PublisherJob:
    """One publisher's share of the fleet and how long it publishes."""

    root: Path
    nodes: tuple[str, ...]
    gpus: int
    url: str
    run_s: int  # whole seconds from the start time
    refresh_s: float  # rebuild each node's sample from the fleet this often (0: never)
    identity: bytes = b""  # the identity key: each node's sample carries its node's MAC
    telemetry_format: int = 2  # v2 as agents send it, or v1 (pre-serialized JSON)


@dataclass(slots=True)
class PublisherResult:
    """What one publisher did, second by second."""

    published: list[int]  # telemetry events sent in each second of the run
    missed: list[int]  # events not sent in each second (more than a second late)
    rebuilt: int = 0  # samples rebuilt from the fleet while publishing
    cpu_s: float = 0.0
    bytes: int = 0  # telemetry payload bytes sent


def publisher_main(job: PublisherJob, conn: Connection) -> None:
    """A publisher process: prime, say so, wait for the start time, publish, report."""
    started = time.perf_counter()
    fleet = SimFleet(root=job.root, nodes=list(job.nodes), gpus=job.gpus)
    now = time.time()
    cache = {node: _render(fleet, node, now, job.telemetry_format) for node in job.nodes}
    conn.send(time.perf_counter() - started)
    t0 = float(conn.recv())
    result = asyncio.run(_publish(job, fleet, cache, t0))
    usage = os.times()
    result.cpu_s = usage.user + usage.system
    conn.send(result)


def _render(fleet: SimFleet, node: str, t: float, fmt: int) -> Any:
    """The `data` part of a node's telemetry event, as JSON for v1, its GPUs for the v2
    writer (None: its agent is silent)."""
    event = fleet.telemetry(node, t)
    if event is None:
        return None
    return json.dumps(event["data"]).encode() if fmt == 1 else event["data"]["gpus"]


async def _publish(
    job: PublisherJob, fleet: SimFleet, cache: dict[str, Any], t0: float
) -> PublisherResult:
    import nats

    nc = await nats.connect(servers(job.url), max_reconnect_attempts=-1, reconnect_time_wait=1)
    result = PublisherResult(published=[0] * job.run_s, missed=[0] * job.run_s)
    nodes = list(job.nodes)
    size = max(1, math.ceil(len(nodes) / CHUNKS_PER_S))
    chunks = [nodes[i : i + size] for i in range(0, len(nodes), size)]
    per_chunk = math.ceil(len(nodes) / (job.refresh_s * CHUNKS_PER_S)) if job.refresh_s else 0
    ids, turn = uuid.uuid4().hex[:12], 0
    keys = KeyRing(job.identity) if job.identity else None
    writer = TelemetryWriter("sim")
    try:
        for second in range(job.run_s):
            for j, chunk in enumerate(chunks):
                slot = t0 + second + j / len(chunks)
                late = time.time() - slot
                if late > 1.0:
                    result.missed[second] += len(chunk)
                    continue
                if late < 0:
                    await asyncio.sleep(-late)
                for _ in range(per_chunk):  # round-robin rebuild, spread over the chunks
                    node = nodes[turn % len(nodes)]
                    cache[node] = _render(fleet, node, time.time(), job.telemetry_format)
                    turn += 1
                now, sent = time.time(), 0
                ts = rfc3339(now)
                for node in chunk:
                    data = cache[node]
                    if data is None:
                        continue
                    if job.telemetry_format == 1:
                        head = (
                            f'{{"id":"{ids}-{second}-{node}","kind":"telemetry","node":"{node}",'
                            f'"ts":"{ts}","source":"sim","data":'
                        )
                        body = head.encode() + data + b"}"
                    else:
                        body = writer.encode(node, now, data, f"{ids}-{second}-{node}")
                    result.bytes += len(body)
                    headers = keys.node(node).headers(body) if keys else None
                    await nc.publish(subjects.telemetry(node), body, headers=headers)
                    sent += 1
                result.published[second] += sent
        await nc.flush(timeout=60)
    finally:
        await nc.close()
    result.rebuilt = turn
    return result


@dataclass
class Replica:
    """One `gpuops run --role engine` process with its own state dir and HTTP port."""

    index: int
    argv: list[str]
    env: dict[str, str]
    work: Path
    http_port: int
    proc: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    ready_s: float | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        """How the report names it."""
        return f"r{self.index}"

    @property
    def base(self) -> str:
        """Its HTTP endpoint."""
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def pid(self) -> int | None:
        """Its process id while it runs."""
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def start(self) -> None:
        """Start it, its output in its log."""
        self._log = (self.work / f"engine-{self.name}.log").open("ab")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.work,
            start_new_session=True,
        )

    def exited(self) -> int | None:
        """Its exit code once it has ended, else None."""
        return None if self.proc is None else self.proc.poll()

    def last_words(self, lines: int = 15) -> str:
        """The end of its log: the bench's work directory is gone once the bench ends,
        so why a replica exited has to be told in the error itself."""
        path = self.work / f"engine-{self.name}.log"
        try:
            text = path.read_text(errors="replace")
        except OSError as exc:
            return f"(its log {path} cannot be read: {exc})"
        return "\n".join(text.rstrip().splitlines()[-lines:]) or "(its log is empty)"

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not stopped in 30 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    async def ready(self, session: aiohttp.ClientSession) -> bool:
        """Whether its /healthz says ready (the time it took is kept the first time)."""
        try:
            async with session.get(f"{self.base}/healthz") as resp:
                ok = resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False
        if ok and self.ready_s is None:
            self.ready_s = time.monotonic() - self.started
        return ok


@dataclass(frozen=True, slots=True)
class Scrape:
    """What one replica's /metrics said, and when."""

    at: float
    telemetry: float  # telemetry events it handled (gpuops_events_total{kind="telemetry"})
    lag: float | None  # its telemetry lag: partition lags summed, else its consumer's pending
    partitions: int | None = None  # partitions it owns (None: before partitioning)


async def scrape(session: aiohttp.ClientSession, replica: Replica) -> Scrape | None:
    """Read a replica's /metrics (None when it did not answer in time)."""
    try:
        async with session.get(f"{replica.base}/metrics") as resp:
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    return parse_metrics(text, time.monotonic())


def parse_metrics(text: str, at: float) -> Scrape:
    """The figures the bench needs from an engine's exposition text."""
    handled, partitions, pending, held = 0.0, [], None, None
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = s.labels
            if s.name == "gpuops_events_total" and labels.get("kind") == "telemetry":
                handled += s.value
            elif s.name == "gpuops_partition_lag" and "TELEMETRY" in labels.get("stream", ""):
                partitions.append(s.value)
            elif s.name == "gpuops_consumer_pending" and "telemetry" in labels.get("consumer", ""):
                pending = (pending or 0.0) + s.value
            elif s.name == "gpuops_partitions_held":
                held = int(s.value)
    lag = sum(partitions) if partitions else pending
    return Scrape(at=at, telemetry=handled, lag=lag, partitions=held)


def cpu_s(pid: int | None) -> float:
    """CPU seconds a process has used (0 once it is gone)."""
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def rss_mb(pid: int | None) -> float:
    """Resident memory of a process in MB (0 once it is gone)."""
    if pid is None:
        return 0.0
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except OSError:
        return 0.0
    return pages * PAGE_KB / 1024.0


def machine_busy_s() -> float:
    """CPU seconds every core of the machine has been busy since boot (anyone's work)."""
    first = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(v) for v in first]
    # user nice system idle iowait irq softirq steal: busy is all but idle, iowait, steal
    return (sum(ticks[:3]) + sum(ticks[5:7])) / CLOCK_TICKS


def engine_argv(
    state_dir: Path, url: str, rules: Path, playbooks: Path, inventory: Path
) -> list[str]:
    """`gpuops run` as an engine replica (no executor: intents stay in the queue)."""
    return [
        sys.executable,
        "-m",
        "gpuops.cli",
        "--state-dir",
        str(state_dir),
        "run",
        "--nats",
        url,
        "--role",
        "engine",
        "--rules",
        str(rules),
        "--playbooks",
        str(playbooks),
        "--inventory",
        str(inventory),
    ]


class Publishers:
    """The publisher processes, each with a slice of the fleet's nodes."""

    def __init__(self, jobs: list[PublisherJob]) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: no copied event loop or sockets
        self.procs: list[tuple[BaseProcess, Connection]] = []
        for job in jobs:
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=publisher_main, args=(job, theirs), daemon=True)
            proc.start()
            theirs.close()
            self.procs.append((proc, mine))

    def primed(self, timeout: float) -> float:
        """Wait until every publisher has built its samples; the longest it took."""
        return max(float(self._recv(conn, timeout, float)) for _, conn in self.procs)

    def go(self, t0: float) -> None:
        """Start publishing at epoch time `t0`."""
        for _, conn in self.procs:
            conn.send(t0)

    def results(self, timeout: float) -> list[PublisherResult]:
        """What each publisher did (they end after their run)."""
        return [self._recv(conn, timeout, PublisherResult) for _, conn in self.procs]

    def cpu_s(self) -> float:
        """CPU seconds of the publishers so far."""
        return sum(cpu_s(proc.pid) for proc, _ in self.procs)

    @staticmethod
    def _recv(conn: Connection, timeout: float, kind: type[T]) -> T:
        try:
            if conn.poll(timeout):
                got = conn.recv()
                if isinstance(got, kind):
                    return got
        except (EOFError, OSError):
            pass
        raise BenchError(f"a publisher did not answer in {timeout:.0f}s (it died?)")

    def stop(self) -> None:
        """End every publisher that is still running."""
        for proc, conn in self.procs:
            if proc.is_alive():
                proc.terminate()
            proc.join(10)
            conn.close()
