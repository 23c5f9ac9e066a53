"""`gpuops bench fleet`: a simulated fleet at 1 Hz against 1, 2, 4... engine replicas on
a local three-server NATS cluster, measured.

Each round starts a fresh cluster (R3 streams and buckets by default), the replicas
(`gpuops run --role engine`, each its own process, state dir and /metrics port, all
with one intent signing key; no executor, so intents stay in the actions queue) and the
publisher processes (procs.py). The clock starts once every replica's /healthz says
ready. After a warm-up (replicas share out partitions, caches fill) the measured window
opens: probe failures are injected on nodes spread over the fleet at a steady rate, and
every few seconds a line gives each replica's handled samples/s and lag. Then the
publishers stop, the replicas drain, and the round reports (figures.py): samples
offered, published and missed; stored, handled and lost to the stream's cap; each
replica's samples/s, CPU and RSS; probe-fail -> intent latency (the intent's
`decided_at` minus the time the event was sent); and the machine's cores, busy cores and
load, since on a small machine the figures are bounded by them.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuops import shipped
from gpuops.bench.fleet.figures import (
    BenchError,
    FleetSpec,
    RoundFigures,
    round_lines,
    summary_lines,
)
from gpuops.bench.fleet.procs import PublisherJob, Publishers, Replica, engine_argv
from gpuops.bench.fleet.round import Round
from gpuops.bus.cluster import LocalCluster
from gpuops.bus.conn import connect
from gpuops.bus.identity import KeyRing
from gpuops.settings import NatsSettings, Settings
from gpuops.signing import load_key
from gpuops.sim.fleet import SimFleet

__all__ = ["BenchError", "FleetSpec", "RoundFigures", "bench_fleet", "run_round"]

Say = Callable[[str], None]
IMPORT_ROOT = Path(__file__).resolve().parents[3]  # the children run this gpuops


def bench_fleet(
    spec: FleetSpec, say: Say, workdir: Path | None = None, keep_logs: Path | None = None
) -> list[RoundFigures]:
    """Create the fleet once, run one round per replica count, print a summary. The work
    directory goes when the bench ends; `keep_logs` keeps each round's replica logs."""
    spec.check()
    with tempfile.TemporaryDirectory(prefix="gpuops-bench-fleet-", dir=workdir) as tmp:
        work = Path(tmp)
        started = time.perf_counter()
        fleet = SimFleet.create(work / "sim", nodes=spec.nodes, gpus=spec.gpus)
        say(
            f"fleet: {spec.nodes} nodes x {spec.gpus} GPUs "
            f"({spec.nodes * spec.gpus:,} GPU samples/s offered at 1 Hz), "
            f"created in {time.perf_counter() - started:.1f}s"
        )
        rounds = []
        for count in spec.replicas:
            round_dir = work / f"round-{count}"
            try:
                figures = run_round(spec, fleet, count, round_dir, say)
            finally:
                if keep_logs is not None:
                    _keep(round_dir, keep_logs / round_dir.name, say)
            for line in round_lines(figures):
                say(line)
            rounds.append(figures)
        for line in summary_lines(rounds):
            say(line)
    return rounds


def _keep(round_dir: Path, into: Path, say: Say) -> None:
    """Copy a round's replica logs out of the work directory before it is deleted."""
    into.mkdir(parents=True, exist_ok=True)
    for log in sorted(round_dir.glob("engine-*.log")):
        shutil.copy2(log, into / log.name)
    say(f"replica logs of {round_dir.name} kept in {into}")


def run_round(spec: FleetSpec, fleet: SimFleet, count: int, work: Path, say: Say) -> RoundFigures:
    """One round on a fresh cluster with `count` replicas."""
    cores = len(os.sched_getaffinity(0))
    work.mkdir(parents=True)
    say(
        f"--- {count} replica(s); R{spec.nats_replicas} streams on a 3-server NATS cluster, "
        f"telemetry v{spec.telemetry_format} in R{spec.telemetry_replicas or spec.nats_replicas} "
        f"{spec.telemetry_storage} storage; {cores} cores, load {os.getloadavg()[0]:.1f}"
    )
    cluster = LocalCluster(work / "nats", size=3).start()
    identity = load_key(_identity_key_file(work), "identity key")  # every publisher's root
    publishers = Publishers(_jobs(spec, fleet, cluster.url, cores, identity))
    replicas = [_replica(spec, fleet, cluster.url, work, i) for i in range(count)]
    try:
        for replica in replicas:
            replica.start()
        round_ = Round(spec, fleet, cluster, replicas, publishers, say, cores, KeyRing(identity))
        return asyncio.run(_measure(round_))
    finally:
        for replica in replicas:
            replica.stop()
        publishers.stop()
        cluster.stop()
        # Three servers' stores hold a GiB of telemetry each: gone before the next round.
        shutil.rmtree(work / "nats", ignore_errors=True)


async def _measure(round_: Round) -> RoundFigures:
    cfg = NatsSettings(replicas=round_.spec.nats_replicas, **_telemetry_stream(round_.spec))
    bus = await connect(round_.cluster.url, cfg, "gpuops-bench", setup="none")
    try:
        return await round_.run(bus)
    finally:
        await bus.close()


def _telemetry_stream(spec: FleetSpec) -> dict[str, Any]:
    """The round's telemetry stream settings (nats.telemetry_*)."""
    out: dict[str, Any] = {"telemetry_storage": spec.telemetry_storage}
    if spec.telemetry_replicas:
        out["telemetry_replicas"] = spec.telemetry_replicas
    return out


def _identity_key_file(work: Path) -> Path:
    """The identity key of every round: replicas check, publishers sign with its keys."""
    return work.parent / "identity.key"


def _jobs(
    spec: FleetSpec, fleet: SimFleet, url: str, cores: int, identity: bytes
) -> list[PublisherJob]:
    n = spec.publisher_count(cores)
    run_s = spec.warmup + spec.seconds
    return [
        PublisherJob(
            fleet.root,
            tuple(fleet.nodes[i::n]),
            spec.gpus,
            url,
            run_s,
            spec.refresh_s,
            identity,
            spec.telemetry_format,
        )
        for i in range(n)
    ]


def _replica(spec: FleetSpec, fleet: SimFleet, url: str, work: Path, i: int) -> Replica:
    key = work.parent / "intent.key"
    load_key(key)  # made once: every replica of every round signs with it
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUOPS_")}
    env |= {
        "PYTHONPATH": str(IMPORT_ROOT),
        "GPUOPS_HTTP": f"127.0.0.1:{port}",
        "GPUOPS_SIGNING_KEY": str(key),
        "GPUOPS_IDENTITY__KEY_FILE": str(_identity_key_file(work)),
        "GPUOPS_NATS__REPLICAS": str(spec.nats_replicas),
        "GPUOPS_NATS__TELEMETRY_STORAGE": spec.telemetry_storage,
        **(
            {"GPUOPS_NATS__TELEMETRY_REPLICAS": str(spec.telemetry_replicas)}
            if spec.telemetry_replicas
            else {}
        ),
        # Injected faults land on distinct nodes: the fleet breaker would turn most of
        # them into drops, which is not what is measured here.
        "GPUOPS_SAFETY__BREAKER_SHARE": "1",
        "GPUOPS_SAFETY__BREAKER_ABSOLUTE": "1000000",
        "GPUOPS_SAFETY__DOMAIN_BUDGETS": "{}",  # nor the racks' budgets
        **replica_id_env(f"bench-r{i}"),
    }
    argv = engine_argv(
        work / f"state-r{i}",
        url,
        shipped.shipped("rules"),
        shipped.shipped("playbooks"),
        fleet.root / "inventory",
    )
    return Replica(i, argv, env, work, port)


def replica_id_env(name: str) -> dict[str, str]:
    """The setting that names a replica, wherever this version of the settings has it."""
    fields = Settings.model_fields
    if "scale" in fields:
        return {"GPUOPS_SCALE__REPLICA_ID": name}
    if "replica_id" in fields:
        return {"GPUOPS_REPLICA_ID": name}
    return {}  # before partitioning: replicas would share one consumer; run one


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])
