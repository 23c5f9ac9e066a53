"""A soak of the whole system as processes: a simulated fleet publishing faults onto a
nats-server, `gpuops run` deciding and running playbooks against it, while the soak stops
NATS for random outages and `kill -9`s the engine on a schedule. At the end it lets the
engine drain and counts, through a NATS client and the simulated nodes' tool calls,
whether every event was accounted for and no remediation ran twice.

    python -m gpuops.bench.soak --nodes 100 --minutes 3 --nats-every 45 --engine-kill-every 60

Exits 1 when an invariant fails (see gpuops.bench.soak_tally.invariants), 2 on a setup error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp
import nats
import yaml
from nats.aio.client import Client

from gpuops import shipped
from gpuops.bench.soak_tally import (
    CONSUMERS,
    audit_tally,
    consumer_state,
    extra_tool_calls,
    invariants,
    stream_counts,
)
from gpuops.bus.server import nats_server_binary
from gpuops.sim.fleet import SimFleet

# The import root of this gpuops (a checkout, or site-packages): the children run this code.
IMPORT_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class SoakConfig:
    """What to soak and how hard."""

    nodes: int = 1000
    gpus: int = 8
    minutes: float = 10.0
    nats_every: float = 120.0
    outage_min: float = 5.0
    outage_max: float = 60.0
    engine_kill_every: float = 180.0
    seed: int = 1
    faults_per_min: float = 0.0  # 0: 1% of the fleet per minute, at least 3
    drain_timeout: float = 300.0
    keep_breaker: bool = False
    workdir: Path | None = None

    @property
    def publish_s(self) -> float:
        """How long the simulator publishes."""
        return self.minutes * 60.0


@dataclass
class Chaos:
    """What the soak did to the system, and what it saw of it."""

    nats_restarts: int = 0
    nats_kills: int = 0  # of the restarts, how many were SIGKILL (the rest SIGTERM)
    outages_s: list[float] = field(default_factory=list)
    engine_kills: int = 0
    engine_exits: list[int] = field(default_factory=list)  # exits the soak did not cause
    healthz: Counter[str] = field(default_factory=Counter)  # ok / bad, while all was up
    longest_unhealthy_s: float = 0.0
    unhealthy_at_s: list[float] = field(default_factory=list)  # soak time of each 'bad'
    given_up: Counter[str] = field(default_factory=Counter)  # max-deliveries advisories
    terminated: Counter[str] = field(default_factory=Counter)  # term()ed messages


def free_port() -> int:
    """A loopback port free now; the soak keeps reusing it across NATS restarts."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Child:
    """One child process in its own process group, so a kill takes its children too
    (as a service manager's kill of the unit's cgroup would)."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str]) -> None:
        self.name, self.argv, self.log, self.env = name, argv, log, env
        self.proc: asyncio.subprocess.Process | None = None
        self.started = 0.0
        self._out: IO[bytes] | None = None

    async def start(self) -> None:
        """Start it, its output appended to its log."""
        self._out = _append(self.log)
        self._out.write(f"--- soak: {self.name} started at {time.time():.3f}\n".encode())
        self._out.flush()
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdout=self._out,
            stderr=asyncio.subprocess.STDOUT,
            env=self.env,
            cwd=self.log.parent,
            start_new_session=True,
        )
        self.started = time.monotonic()

    def running(self) -> bool:
        """Started and not exited."""
        return self.proc is not None and self.proc.returncode is None

    def up_for(self) -> float:
        """Seconds since it started, 0 when it is not running."""
        return time.monotonic() - self.started if self.running() else 0.0

    async def stop(self, sig: int = signal.SIGTERM, grace: float = 20.0) -> int | None:
        """Signal its process group; SIGKILL the group if it outlives `grace`."""
        proc = self.proc
        if proc is None:
            return None
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                await asyncio.wait_for(proc.wait(), grace)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        return self._reap()

    def exited(self) -> int | None:
        """The exit code when it has ended on its own since the last look, else None."""
        if self.proc is None or self.proc.returncode is None:
            return None
        return self._reap()

    def _reap(self) -> int | None:
        proc, self.proc = self.proc, None
        if self._out is not None:
            self._out.close()
            self._out = None
        return None if proc is None else proc.returncode


def _append(log: Path) -> IO[bytes]:
    """The child's log, opened for appending (closed when the child is reaped)."""
    return open(log, "ab")


def _count_in(log: Path, text: str) -> int:
    """How often `text` occurs in a log (0 before it exists)."""
    return log.read_text(errors="replace").count(text) if log.exists() else 0


class System:
    """The three processes under test and their files under one work dir."""

    def __init__(self, cfg: SoakConfig, work: Path) -> None:
        self.cfg, self.work = cfg, work
        self.port, self.http_port = free_port(), free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.fleet_root, self.inventory = work / "fleet", work / "fleet" / "inventory"
        env = {**os.environ, "PYTHONPATH": str(IMPORT_ROOT)}
        if not cfg.keep_breaker:
            # The soak is about crashes and outages: keep the fleet breaker (tested on its
            # own by the storm demo) and the racks' budgets from turning most faults into
            # breaker_open and domain_budget drops.
            env |= {
                "GPUOPS_SAFETY__BREAKER_SHARE": "1",
                "GPUOPS_SAFETY__BREAKER_ABSOLUTE": "1000000",
                "GPUOPS_SAFETY__DOMAIN_BUDGETS": "{}",
            }
        nats_argv = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js"]
        nats_argv += ["-sd", str(work / "nats"), "-l", str(work / "nats-server.log")]
        self.nats = Child("nats-server", nats_argv, work / "nats-server.out", env)
        self.engine = Child("engine", self._engine_argv(), work / "gpuops.log", env)
        self.sim = Child("simulator", self._sim_argv(), work / "simulator.log", env)

    def _gpuops(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "gpuops.cli", "--state-dir", str(self.work / "state"), *args]

    def _engine_argv(self) -> list[str]:
        return self._gpuops(
            "run",
            "--nats",
            self.url,
            "--rules",
            str(shipped.shipped("rules")),
            "--playbooks",
            str(shipped.shipped("playbooks")),
            "--inventory",
            str(self.inventory),
            "--http",
            f"127.0.0.1:{self.http_port}",
        )

    def _sim_argv(self) -> list[str]:
        cfg = self.cfg
        return self._gpuops(
            "simulate",
            "--nodes",
            str(cfg.nodes),
            "--gpus",
            str(cfg.gpus),
            "--root",
            str(self.fleet_root),
            "--inventory-dir",
            str(self.inventory),
            "--run",
            str(cfg.publish_s),
            "--scenario",
            str(self.work / "soak-scenario.yml"),
            "--nats",
            self.url,
        )

    async def start_nats(self) -> None:
        """Start nats-server on the soak's port and store; wait until it takes clients."""
        log = self.work / "nats-server.log"
        ready_before = _count_in(log, "Server is ready")
        await self.nats.start()
        deadline = time.monotonic() + 60  # a big store takes a while to recover
        while time.monotonic() < deadline:
            if _count_in(log, "Server is ready") > ready_before:
                return
            if not self.nats.running():
                raise RuntimeError(f"nats-server exited; see {log}")
            await asyncio.sleep(0.05)
        raise RuntimeError("nats-server did not become ready in 60 s")

    async def stop_all(self) -> None:
        """Everything down, politely, the engine first so it can flush."""
        for child in (self.sim, self.engine, self.nats):
            await child.stop(signal.SIGTERM, grace=20.0)


def scenario(cfg: SoakConfig, nodes: list[str]) -> dict[str, Any]:
    """Faults on distinct nodes spread over the first 80% of the run, a mix that leads to
    GPU resets, reboots (and probes back to service), drains and power caps."""
    rng = random.Random(cfg.seed)
    per_min = cfg.faults_per_min or max(3.0, cfg.nodes / 100.0)
    count = max(1, round(per_min * cfg.minutes))
    kinds: list[tuple[dict[str, Any], int]] = [
        ({"fault": "xid", "xid": 74}, 4),  # gpu_reset.yml
        ({"fault": "xid", "xid": 48}, 1),  # gpu_reset.yml
        ({"fault": "zombie"}, 2),  # probe fails -> gpu_reset.yml
        ({"fault": "xid", "xid": 79}, 2),  # reboot.yml, probe, return_to_service.yml
        ({"fault": "overheat"}, 1),  # drain.yml
        ({"fault": "power_limit", "watts": 400}, 1),  # power_limit.yml
    ]
    order = rng.sample(nodes, len(nodes))
    faults = []
    for i in range(count):
        spec = rng.choices([k for k, _ in kinds], weights=[w for _, w in kinds])[0]
        at = 5.0 + rng.uniform(0, 0.8 * cfg.publish_s)
        node = order[i % len(order)]
        faults.append({"at": f"{at:.1f}s", "node": node, "gpu": rng.randrange(cfg.gpus), **spec})
    faults.sort(key=lambda f: float(str(f["at"])[:-1]))
    return {"name": "soak", "description": "faults on many nodes over time", "faults": faults}


async def nats_chaos(system: System, cfg: SoakConfig, chaos: Chaos, end: float) -> None:
    """Every `nats_every` s stop nats-server (TERM or KILL) and bring it back after an outage
    of `outage_min..outage_max` s, on the same port and store; none may outlast `end`."""
    rng = random.Random(cfg.seed + 1)
    while True:
        await asyncio.sleep(cfg.nats_every)
        outage = rng.uniform(cfg.outage_min, cfg.outage_max)
        if time.monotonic() + outage + 15 > end:
            return
        sig = rng.choice([signal.SIGTERM, signal.SIGKILL])
        await system.nats.stop(sig, grace=10.0)
        chaos.nats_restarts += 1
        chaos.nats_kills += sig == signal.SIGKILL
        chaos.outages_s.append(round(outage, 1))
        print(f"soak: nats-server down ({sig.name}) for {outage:.0f}s", file=sys.stderr)
        await asyncio.sleep(outage)
        await system.start_nats()


async def engine_chaos(system: System, cfg: SoakConfig, chaos: Chaos, end: float) -> None:
    """`kill -9` the engine every `engine_kill_every` s and start it again; restart it at
    once when it exits on its own (as a service manager would), counting those exits."""
    next_kill = time.monotonic() + cfg.engine_kill_every
    while time.monotonic() < end:
        await asyncio.sleep(0.5)
        code = system.engine.exited()
        if code is not None:
            chaos.engine_exits.append(code)
            print(f"soak: engine exited on its own (rc={code}); restarting", file=sys.stderr)
            await system.engine.start()
        if time.monotonic() >= next_kill:
            await system.engine.stop(signal.SIGKILL)
            chaos.engine_kills += 1
            print("soak: engine kill -9", file=sys.stderr)
            await system.engine.start()
            next_kill += cfg.engine_kill_every


async def watch_health(system: System, chaos: Chaos, t0: float) -> None:
    """Poll /healthz; count answers only while NATS and the engine have both been up for
    20 s, so a 'bad' is an engine that did not recover, not one still reconnecting."""
    url = f"http://127.0.0.1:{system.http_port}/healthz"
    bad_since: float | None = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as http:
        while True:
            await asyncio.sleep(5)
            if min(system.nats.up_for(), system.engine.up_for()) < 20:
                bad_since = None
                continue
            ok = await _healthy(http, url)
            chaos.healthz["ok" if ok else "bad"] += 1
            now = time.monotonic()
            if not ok:
                chaos.unhealthy_at_s.append(round(now - t0))
                # one bad answer counts as a poll interval of being unhealthy
                bad_since = bad_since or now - 5
                chaos.longest_unhealthy_s = max(chaos.longest_unhealthy_s, now - bad_since)
            else:
                bad_since = None


async def _healthy(http: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with http.get(url) as resp:
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def watch_advisories(system: System, chaos: Chaos) -> Client:
    """Count messages JetStream gave up on (max deliveries) or that were terminated.
    Advisories sent while this client is reconnecting are missed; the counts are a floor."""

    async def quiet(exc: Exception) -> None:
        pass  # outages are the point of the soak; the engine's log tells them already

    nc = await nats.connect(
        system.url, max_reconnect_attempts=-1, reconnect_time_wait=0.5, error_cb=quiet
    )

    async def given_up(msg: Any) -> None:
        chaos.given_up[".".join(msg.subject.split(".")[-2:])] += 1

    async def terminated(msg: Any) -> None:
        chaos.terminated[".".join(msg.subject.split(".")[-2:])] += 1

    await nc.subscribe("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.>", cb=given_up)
    await nc.subscribe("$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.>", cb=terminated)
    return nc


async def drain(system: System, limit_s: float) -> tuple[bool, float]:
    """Wait until the engine's and executor's consumers have nothing pending or unacked,
    twice in a row (a finished run can still queue a follow-up)."""
    started = time.monotonic()
    nc = await nats.connect(system.url)
    try:
        js, quiet = nc.jetstream(timeout=10), 0
        while time.monotonic() - started < limit_s and quiet < 2:
            states = [await consumer_state(js, s, d) for s, d in CONSUMERS]
            idle = all(st.get("pending", 0) + st.get("ack_pending", 0) == 0 for st in states)
            quiet = quiet + 1 if idle else 0
            await asyncio.sleep(2)
        return quiet >= 2, time.monotonic() - started
    finally:
        await nc.close()


async def count(system: System, chaos: Chaos) -> dict[str, Any]:
    """The figures, read through a NATS client and the fleet's call logs."""
    nc = await nats.connect(system.url)
    try:
        js = nc.jetstream(timeout=30)
        counts = await stream_counts(js)
        tally = await audit_tally(js)
    finally:
        await nc.close()
    extra = extra_tool_calls(system.fleet_root / "nodes", tally)
    return invariants(counts, tally, extra, chaos.given_up.get("GPUOPS_EVENTS.gpuops-engine", 0))


def simulator_stats(log: Path) -> dict[str, int]:
    """The `key=value` figures `gpuops simulate --run` printed at its end."""
    stats: dict[str, int] = {}
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        for word in line.split():
            key, sep, value = word.partition("=")
            if sep and value.isdigit():
                stats[key] = int(value)
    return stats


async def soak(cfg: SoakConfig) -> dict[str, Any]:
    """Run the soak; the summary's `failed` lists the invariants that did not hold."""
    with contextlib.ExitStack() as stack:
        work = cfg.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="soak-")))
        work.mkdir(parents=True, exist_ok=True)
        system = System(cfg, work)
        try:
            return await _soak(system, cfg)
        finally:
            await system.stop_all()


async def _soak(system: System, cfg: SoakConfig) -> dict[str, Any]:
    fleet = SimFleet.create(system.fleet_root, cfg.nodes, cfg.gpus, seed=cfg.seed)
    plan = scenario(cfg, fleet.nodes)
    (system.work / "soak-scenario.yml").write_text(yaml.safe_dump(plan))
    chaos = Chaos()
    await system.start_nats()
    advisories = await watch_advisories(system, chaos)
    t0 = time.monotonic()
    await system.sim.start()
    await _wait_for_text(system.sim.log, "inventory:", 300)  # it re-creates the fleet
    await system.engine.start()
    end = t0 + cfg.publish_s
    tasks = [
        asyncio.create_task(nats_chaos(system, cfg, chaos, end)),
        asyncio.create_task(engine_chaos(system, cfg, chaos, end)),
        asyncio.create_task(watch_health(system, chaos, t0)),
    ]
    try:
        sim_rc = await _until_published(system, tasks[:2], cfg)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if not system.nats.running():
        await system.start_nats()
    if not system.engine.running():
        chaos.engine_exits += [c for c in [system.engine.exited()] if c is not None]
        await system.engine.start()
    drained, waited = await drain(system, cfg.drain_timeout)
    await system.engine.stop(signal.SIGTERM)
    figures = await count(system, chaos)
    await advisories.close()
    return _summary(cfg, chaos, figures, sim_rc, drained, waited, len(plan["faults"]), system)


async def _until_published(
    system: System, chaos_tasks: list[asyncio.Task[None]], cfg: SoakConfig
) -> int | None:
    """Wait for the simulator to end its run (it stops itself); chaos errors surface here."""
    deadline = time.monotonic() + cfg.publish_s + cfg.outage_max + 180
    assert system.sim.proc is not None
    wait = asyncio.create_task(system.sim.proc.wait())
    while not wait.done() and time.monotonic() < deadline:
        await asyncio.wait([wait, *chaos_tasks], timeout=5, return_when=asyncio.FIRST_COMPLETED)
        for task in chaos_tasks:
            if task.done() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    if not wait.done():
        wait.cancel()
        return await system.sim.stop(signal.SIGTERM)
    return system.sim.exited()


async def _wait_for_text(log: Path, text: str, limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if _count_in(log, text):
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{log.name}: no {text!r} within {limit_s:.0f}s")


def _summary(
    cfg: SoakConfig,
    chaos: Chaos,
    figures: dict[str, Any],
    sim_rc: int | None,
    drained: bool,
    waited: float,
    faults: int,
    system: System,
) -> dict[str, Any]:
    checks: dict[str, bool] = dict(figures.pop("checks"))
    checks["simulator ran to its end"] = sim_rc == 0
    checks["engine drained within the deadline"] = drained
    checks["engine exited only when killed"] = not chaos.engine_exits
    checks["engine healthy whenever NATS was up"] = not chaos.healthz.get("bad")
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}
    return {
        "config": config,
        "faults_planned": faults,
        "simulator": {"rc": sim_rc, **simulator_stats(system.sim.log)},
        "chaos": {**_plain(chaos), "drain_s": round(waited, 1)},
        **figures,
        "checks": checks,
        "failed": [name for name, ok in checks.items() if not ok],
        "workdir": str(system.work) if cfg.workdir else None,
    }


def _plain(chaos: Chaos) -> dict[str, Any]:
    # Not dataclasses.asdict: it rebuilds a Counter from (key, value) pairs, counting pairs.
    return {k: dict(v) if isinstance(v, Counter) else v for k, v in vars(chaos).items()}


def render(summary: dict[str, Any]) -> str:
    """The summary as text, one figure per line."""
    lines = ["soak summary"]
    for key, value in summary.items():
        if key not in ("checks", "failed", "warnings"):
            lines.append(f"  {key}: {json.dumps(value, sort_keys=True, default=str)}")
    for name, ok in summary["checks"].items():
        lines.append(f"  [{'ok' if ok else 'FAIL'}] {name}")
    lines += [f"  [warn] {w}" for w in summary.get("warnings", [])]
    lines.append("PASS" if not summary["failed"] else f"FAIL: {len(summary['failed'])} invariants")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    """The command line of `python -m gpuops.bench.soak` (and `gpuops bench soak`)."""
    p = argparse.ArgumentParser(prog="gpuops bench soak", description=__doc__.split("\n\n")[0])
    d = SoakConfig()
    p.add_argument("--nodes", type=int, default=d.nodes)
    p.add_argument("--gpus", type=int, default=d.gpus)
    p.add_argument("--minutes", type=float, default=d.minutes, help="how long the fleet publishes")
    p.add_argument("--nats-every", type=float, default=d.nats_every, help="s between NATS stops")
    p.add_argument("--outage-min", type=float, default=d.outage_min)
    p.add_argument("--outage-max", type=float, default=d.outage_max)
    p.add_argument("--engine-kill-every", type=float, default=d.engine_kill_every)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--faults-per-min", type=float, default=d.faults_per_min, help="0: nodes/100")
    p.add_argument("--drain-timeout", type=float, default=d.drain_timeout)
    p.add_argument("--keep-breaker", action="store_true", help="keep the fleet breaker's defaults")
    p.add_argument("--workdir", type=Path, help="keep the run's files here (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="the summary as one JSON object")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the soak; print its summary; 0 when every invariant held, 1 when not."""
    args = vars(parser().parse_args(argv))
    as_json = args.pop("json")
    cfg = SoakConfig(**args)
    try:
        summary = asyncio.run(soak(cfg))
    except (RuntimeError, OSError) as exc:
        print(f"soak: setup failed: {exc}", file=sys.stderr)
        return 2
    if cfg.workdir is not None:
        (cfg.workdir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(json.dumps(summary, sort_keys=True, default=str) if as_json else render(summary))
    return 0 if not summary["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
