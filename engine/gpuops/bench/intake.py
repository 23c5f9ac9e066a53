"""`gpuops bench intake`: what the engine's intake costs per GPU sample, and how long a
health event takes to become an intent while telemetry streams in behind it.

A real embedded nats-server; a publisher in its own process sends every node's
8-GPU sample once a second (paced in slices of the second, the samples built from the
H200 recording as the simulated fleet builds them) and, over the measured seconds,
XID 48 events on distinct GPUs; this process runs the engine (role `engine`: intake,
match, decide, intents; no executor) with the shipped rules on an in-memory simulated
inventory. The engine's CPU is this process's CPU time over the measured seconds; the
latency of a health event is its intent's `decided_at` minus the event's time, which
the publisher sets to the moment it publishes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuops import shipped, subjects
from gpuops.bus.identity import KeyRing
from gpuops.bus.wire import TelemetryWriter
from gpuops.clock import rfc3339, to_datetime

WARMUP_S = 5.0
SLICES = 50  # a second's samples go out in this many slices, as agents' clocks spread them
VARIANTS = 16  # distinct 8-GPU samples (recording offsets) shared by the nodes
RACK_SIZE = 4


@dataclass(frozen=True)
class IntakeBench:
    """What to measure."""

    gpus: int = 50_000
    gpus_per_node: int = 8
    seconds: float = 20.0
    health: int = 200
    partitions: int = 8
    warmup_s: float = WARMUP_S
    telemetry_format: int = 2  # what the publisher sends (gpuops.bus.wire)
    linger_ms: float | None = None  # intake_linger_ms; None: the settings' default

    @property
    def nodes(self) -> int:
        """Nodes the publisher speaks for."""
        return max(1, self.gpus // self.gpus_per_node)


def node_names(n: int) -> list[str]:
    """The bench's node names."""
    return [f"node-{i:05d}" for i in range(n)]


def bench_intake(spec: IntakeBench) -> Iterator[str]:
    """Run the bench and yield its report, line by line."""
    result = asyncio.run(_bench(spec))
    yield from render(spec, result)


def render(spec: IntakeBench, r: dict[str, Any]) -> Iterator[str]:
    """The report of one run."""
    yield (
        f"fleet: {spec.nodes} nodes x {spec.gpus_per_node} GPUs at 1 Hz "
        f"({spec.nodes * spec.gpus_per_node} samples/s offered, {spec.partitions} partitions, "
        f"linger {r['linger_ms']:.0f} ms, "
        f"telemetry v{spec.telemetry_format}), "
        f"{spec.seconds:.0f} s measured "
        f"after {spec.warmup_s:.0f} s warm-up; {os.cpu_count()} cores, "
        f"load average {r['load']:.2f} at the start, {r['load_end']:.2f} at the end"
    )
    yield f"publisher: {r['published']} samples sent, at most {r['publisher_late_s']:.2f} s late"
    yield (
        f"wire: {r['bytes_per_gpu']:.0f} bytes per GPU sample over the run "
        f"({r['keyframes']} keyframes of {r['keyframe_bytes']:,} bytes each included; "
        f"{r['steady_bytes_per_gpu']:.0f} without them)"
    )
    yield (
        f"handled: {r['samples_per_s']:,.0f} GPU samples/s "
        f"({r['samples']:,} samples in {r['wall_s']:.1f} s), "
        f"telemetry backlog at the end {r['pending']:,} messages; "
        f"{r['pulled'] / max(1, r['pulls']):.1f} messages a pull ({r['pulls']:,.0f} pulls)"
    )
    yield (
        f"engine CPU: {r['cpu_s']:.2f} s (of it {r['system_s']:.2f} s in the kernel), "
        f"{r['cpu_per_1k']:.4f} CPU s per 1,000 samples "
        f"({100 * r['cpu_s'] / r['wall_s']:.0f}% of one core)"
    )
    live_us = r["cpu_s"] / max(1, r["samples"]) * 1e6
    yield (
        f"same samples offline ({r['offline_samples']:,}): replay {r['replay_us']:.1f} us a "
        f"sample (of it decoding {r['decode_us']:.1f}, observers {r['observe_us']:.1f}, "
        f"matcher {r['match_us']:.1f}); live {live_us:.1f} us, "
        f"live/replay {live_us / max(r['replay_us'], 1e-9):.2f}; of live, the loop's time "
        f"handling the pulled telemetry {r['handling_s'] / max(1, r['samples']) * 1e6:.1f} us"
        + (f" ({r['replay_refused']} lines refused by replay)" if r["replay_refused"] else "")
    )
    if r["nats_cpu_s"] is not None:
        yield (
            f"nats-server CPU: {r['nats_cpu_s']:.2f} s, "
            f"{r['nats_cpu_s'] / max(1, r['samples']) * 1000:.4f} CPU s per 1,000 samples"
        )
    lat = r["latency_ms"]
    if lat:
        yield (
            f"xid -> intent: {len(lat)}/{r['health']} intents, p50 {_pct(lat, 50):.1f} ms, "
            f"p99 {_pct(lat, 99):.1f} ms, max {max(lat):.1f} ms"
        )
    else:
        yield f"xid -> intent: no intent of {r['health']} health events"
    gcs = ", ".join(
        f"gen{g} {v['n']} x (total {v['total_ms']:.0f} ms, longest {v['max_ms']:.1f} ms)"
        for g, v in r["gc"].items()
    )
    yield f"garbage collector: {gcs}; {r['tracked']:,} objects tracked at the end"
    yield f"other decisions: {json.dumps(r['other_intents'])}"


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


async def _bench(spec: IntakeBench) -> dict[str, Any]:
    from gpuops.bus.server import EmbeddedNats

    with tempfile.TemporaryDirectory(prefix="gpuops-bench-intake-") as tmp:
        server = EmbeddedNats(Path(tmp) / "nats").start()
        try:
            return await _with_server(spec, server.url, Path(tmp), server.pid)
        finally:
            server.stop()


async def _with_server(spec: IntakeBench, url: str, work: Path, pid: int | None) -> dict[str, Any]:
    from gpuops.bus.conn import connect
    from gpuops.clock import SystemClock
    from gpuops.match.loader import load_rules
    from gpuops.spine.app import App
    from gpuops.spine.heap import settle_heap

    settings = _settings(work, url, spec.partitions, spec.linger_ms)
    inventory = _inventory(spec)
    rules = load_rules([settings.rules_dir], settings.playbooks_dir, inventory)
    bus = await connect(url, settings.nats)
    app = App(settings=settings, bus=bus, clock=SystemClock(), rules=rules, inventory=inventory)
    settle_heap()  # as `gpuops run` does once it has loaded
    engine = asyncio.create_task(app.run())
    try:
        out = await _measure(spec, url, app, pid)
        out["linger_ms"] = settings.intake_linger_ms
        out["pending"] = await _pending(bus, app.settings.nats.partitions)
        await _settle(app, spec)
        out.update(await _intents(bus, spec))
        app.stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(engine, 30)
        out.update(await _offline(bus, settings, rules, inventory, work))
        return out
    finally:
        app.stop.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(engine, 30)
        await bus.close()


async def _offline(
    bus: Any, settings: Any, rules: Any, inventory: Any, work: Path
) -> dict[str, Any]:
    """The same samples off the stream (`gpuops export`), replayed (`gpuops replay`: the
    live engine's code on memory stores) and through the matcher alone, once the live
    engine has stopped: CPU per GPU sample of each."""
    from gpuops.intake.compact import FactsBook
    from gpuops.intake.decode import decode_line
    from gpuops.match.facts import facts_of
    from gpuops.match.matcher import Matcher
    from gpuops.ops.export import Selection, export
    from gpuops.spine.replay import replay

    path = work / "recording.jsonl"
    with path.open("wb") as out:
        await export(bus.js, Selection(kinds=("telemetry",)), out)
    offline = settings.model_copy(
        update={"safety": settings.safety.model_copy(update={"stale_after_s": float("inf")})}
    )
    cpu = time.process_time()
    _, report = await replay(path, rules, None, offline)
    replay_cpu = time.process_time() - cpu
    lines, book = path.read_bytes().splitlines(), FactsBook()
    cpu = time.process_time()
    for line in lines:
        decode_line(line, book)  # each dropped, as live: kept, 200,000 facts time the heap
    decode_cpu = time.process_time() - cpu
    book = FactsBook()
    events = [decode_line(line, book) for line in lines]
    samples = sum(len(facts_of(e)) for e in events)
    observers = _observers(settings, inventory)
    cpu = time.process_time()
    for e in events:
        for observe in observers:
            observe(e)
    observe_cpu = time.process_time() - cpu
    matcher = Matcher(rules)
    cpu = time.process_time()
    for e in events:
        matcher.match(e)
    match_cpu = time.process_time() - cpu
    per = 1e6 / max(1, samples)
    return {
        "offline_samples": samples,
        "replay_us": replay_cpu * per,
        "decode_us": decode_cpu * per,
        "observe_us": observe_cpu * per,
        "match_us": match_cpu * per,
        "replay_refused": report.refusals(),
    }


def _observers(settings: Any, inventory: Any) -> list[Callable[[Any], None]]:
    """What replay's pipeline shows every telemetry sample besides the matcher, built as
    the engine builds them: density and the power controller (live adds the console's
    heatmap, which replay has not)."""
    from gpuops.power.controller import PowerController
    from gpuops.power.engine import node_policies, observer
    from gpuops.record.density import DensityTracker

    controller = PowerController(settings.power, node_policies(inventory, settings.power))
    return [DensityTracker().observe, observer(controller)]


async def _pending(bus: Any, partitions: int) -> int:
    """Telemetry not yet delivered, over every partition's consumer."""
    from gpuops.scale.lag import lags

    return sum(lag.pending for lag in await lags(bus.js, True, partitions))


def _settings(work: Path, url: str, partitions: int, linger_ms: float | None = None) -> Any:
    from gpuops.settings import Settings

    linger = {} if linger_ms is None else {"intake_linger_ms": linger_ms}

    return Settings.model_validate(
        {
            "state_dir": work / "state",
            "rules_dir": shipped.shipped("rules"),
            "playbooks_dir": shipped.shipped("playbooks"),
            "inventory": work / "inventory",
            "nats": {"url": url, "partitions": partitions},
            "role": "engine",
            # A bench acts on hundreds of nodes in seconds: the breaker and the racks'
            # budgets would stop it.
            "safety": {"breaker_absolute": 1_000_000, "breaker_share": 1.0, "domain_budgets": {}},
            **linger,
        }
    )


def _inventory(spec: IntakeBench) -> Any:
    """The simulated fleet's inventory, built in memory (no Ansible parse)."""
    from gpuops.inventory.hosts import Inventory
    from gpuops.sim.state import H200

    names = node_names(spec.nodes)
    hostvars = {
        n: {"workload_manager": "slurm", "gpu_power_policy_w": H200["power_default_limit_w"]}
        for n in names
    }
    groups = {"sim": frozenset(names), "h200": frozenset(names)}
    for i in range(0, len(names), RACK_SIZE):
        groups[f"rack-a{i // RACK_SIZE + 1}"] = frozenset(names[i : i + RACK_SIZE])
    return Inventory(Path("<bench>"), frozenset(names), groups, hostvars)


class GcPauses:
    """The garbage collector's pauses while measuring: the loop stands still during each
    (a collection walks every tracked object of its generations)."""

    def __init__(self) -> None:
        self.pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._began = 0.0

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *_: object) -> None:
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.pauses[info["generation"]].append((time.perf_counter() - self._began) * 1000)

    def summary(self) -> dict[str, Any]:
        """Per generation: collections, total and longest pause (ms)."""
        return {
            str(g): {"n": len(p), "total_ms": sum(p), "max_ms": max(p, default=0.0)}
            for g, p in self.pauses.items()
        }


def _process_cpu(pid: int | None) -> float | None:
    """A process's user + system CPU seconds (Linux /proc), None where unreadable."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(spec: IntakeBench, url: str, app: Any, pid: int | None) -> dict[str, Any]:
    from gpuops.record.metrics import total
    from gpuops.spine.app import identity_key_path

    argv = [sys.executable, "-m", "gpuops.bench.intake", url, str(spec.nodes)]
    argv += [str(spec.gpus_per_node), str(spec.warmup_s), str(spec.seconds), str(spec.health)]
    argv += ["--identity-key", str(identity_key_path(app.settings))]
    argv += ["--telemetry-format", str(spec.telemetry_format)]
    child = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
    assert child.stdout is not None
    start = float((await child.stdout.readline()).decode().split()[1])
    events = app.engine.metrics.events
    await asyncio.sleep(max(0.0, start + spec.warmup_s - time.time()))
    load, cpu0, n0, t0 = os.getloadavg()[0], _cpu(), total(events, "telemetry"), time.monotonic()
    sys0 = os.times().system
    nats0, pulls0 = _process_cpu(pid), _pulls(app)
    with GcPauses() as gc_pauses:
        await asyncio.sleep(max(0.0, start + spec.warmup_s + spec.seconds - time.time()))
    cpu1, n1, t1 = _cpu(), total(events, "telemetry"), time.monotonic()
    sys1 = os.times().system
    nats1, pulls1 = _process_cpu(pid), _pulls(app)
    report = json.loads((await child.stdout.read()).decode().strip().splitlines()[-1])
    await child.wait()
    samples = int((n1 - n0) * spec.gpus_per_node)
    return {
        "load": load,
        "load_end": os.getloadavg()[0],
        "published": report["published"],
        "publisher_late_s": report["late_s"],
        "samples": samples,
        "wall_s": t1 - t0,
        "samples_per_s": samples / (t1 - t0),
        "cpu_s": cpu1 - cpu0,
        "system_s": sys1 - sys0,
        "cpu_per_1k": (cpu1 - cpu0) / max(1, samples) * 1000,
        "nats_cpu_s": None if nats0 is None or nats1 is None else nats1 - nats0,
        "bytes_per_gpu": report["bytes"] / max(1, report["published"] * spec.gpus_per_node),
        "steady_bytes_per_gpu": report["steady_bytes"]
        / max(1, (report["published"] - report["keyframes"]) * spec.gpus_per_node),
        "pulls": pulls1[0] - pulls0[0],
        "pulled": pulls1[1] - pulls0[1],
        "handling_s": pulls1[2] - pulls0[2],
        "keyframes": report["keyframes"],
        "keyframe_bytes": report["keyframe_bytes"],
        "health": spec.health,
        "gc": gc_pauses.summary(),
        "tracked": len(gc.get_objects()),
    }


def _pulls(app: Any) -> tuple[float, float, float]:
    """Telemetry pulls that brought messages so far, the messages they brought, and the
    seconds their handling took (the loop's clock)."""
    from gpuops.bus.conn import TELEMETRY

    registry, labels = app.engine.metrics.registry, {"stream": TELEMETRY}
    count = registry.get_sample_value("gpuops_intake_batch_messages_count", labels)
    brought = registry.get_sample_value("gpuops_intake_batch_messages_sum", labels)
    busy = registry.get_sample_value("gpuops_intake_handling_seconds_total", labels)
    return count or 0.0, brought or 0.0, busy or 0.0


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


async def _settle(app: Any, spec: IntakeBench) -> None:
    """Give the engine a few seconds for the last health events' decisions."""
    from gpuops.record.metrics import total

    for _ in range(75):  # at most 15 s
        if total(app.engine.metrics.events, "xid") >= spec.health:
            break
        await asyncio.sleep(0.2)
    await asyncio.sleep(0.5)


async def _intents(bus: Any, spec: IntakeBench) -> dict[str, Any]:
    """Latency of every intent for a bench XID; a count of the others, by rule."""
    from nats.errors import TimeoutError as NatsTimeout

    from gpuops.bus.conn import ACTIONS
    from gpuops.models import Intent

    sub = await bus.js.pull_subscribe(subjects.ACTIONS, stream=ACTIONS)
    latency: list[float] = []
    others: dict[str, int] = {}
    while True:
        try:
            msgs = await sub.fetch(256, timeout=1.0)
        except (NatsTimeout, TimeoutError):
            break
        for msg in msgs:
            intent = Intent.model_validate_json(msg.data)
            if intent.event_id.startswith("bench-xid-"):
                latency.append((intent.decided_at - intent.event_ts) * 1000)
            else:
                others[intent.rule] = others.get(intent.rule, 0) + 1
    await sub.unsubscribe()
    return {"latency_ms": latency, "other_intents": others}


# --- the publisher (its own process) ----------------------------------------------------


def _samples(gpus: int) -> list[bytes]:
    """VARIANTS 8-GPU `data` objects from the recording, as the simulated fleet makes them."""
    from gpuops.sim.fleet import _gpu_sample, h200_trace
    from gpuops.sim.state import new_node

    state = new_node("node-bench", gpus)
    n = len(h200_trace())
    out = []
    for k in range(VARIANTS):
        rng = random.Random(k)
        at = time.time() + k * n // VARIANTS
        data = {"gpus": [_gpu_sample(g, state, at, g["index"] * 7, rng) for g in state["gpus"]]}
        out.append(json.dumps(data, separators=(",", ":")).encode())
    return out


def _telemetry(node: str, ts: bytes, seq: int, data: bytes) -> bytes:
    head = f'{{"id":"{node}-{seq}","kind":"telemetry","node":"{node}","ts":"'.encode()
    return head + ts + b'","source":"bench","data":' + data + b"}"


def _xid(i: int, node: str, gpus: int) -> bytes:
    ts = to_datetime(time.time()).isoformat(timespec="microseconds").replace("+00:00", "Z")
    event = {
        "id": f"bench-xid-{i}",
        "kind": "xid",
        "node": node,
        "ts": ts,
        "source": "bench",
        "data": {"gpu": i % gpus, "xid": 48, "message": "bench"},
    }
    return json.dumps(event).encode()


async def publish(
    url: str,
    nodes: int,
    gpus: int,
    warmup_s: float,
    seconds: float,
    health: int,
    identity: bytes = b"",
    telemetry_format: int = 2,
) -> dict[str, Any]:
    """Send every node's sample once a second for warm-up + seconds, and the XIDs, each
    with its node's MAC (as agents sign them) when given the identity key; telemetry in
    format v1 (pre-serialized, as fast as a publisher can be) or v2 (as agents write it)."""
    import nats

    nc = await nats.connect(url, pending_size=256 * 1024 * 1024)
    names = node_names(nodes)
    keys = KeyRing(identity) if identity else None
    signers = [keys.node(n) if keys else None for n in names]
    tel = [subjects.telemetry(n) for n in names]
    datas = _samples(gpus)
    variants = [json.loads(d)["gpus"] for d in datas]
    writer = TelemetryWriter("bench", version=telemetry_format)
    sizes = {"bytes": 0, "steady_bytes": 0, "keyframes": 0, "keyframe_bytes": 0}
    step = max(1, nodes // max(1, health))
    due = [(warmup_s + (i + 0.5) * seconds / health, i) for i in range(health)]
    start = float(int(time.time()) + 1)
    print(f"start {start}", flush=True)
    per = -(-nodes // SLICES)
    sent, late = 0, 0.0
    for sec in range(int(warmup_s + seconds)):
        for s in range(SLICES):
            at = start + sec + s / SLICES
            late = max(late, time.time() - at)
            await asyncio.sleep(max(0.0, at - time.time()))
            now = time.time()
            ts = rfc3339(now).encode()
            for i in range(s * per, min(nodes, (s + 1) * per)):
                if telemetry_format == 1:
                    body = _telemetry(names[i], ts, sec, datas[(i + sec) % VARIANTS])
                else:
                    before = writer.keyframes
                    body = writer.encode(names[i], now, variants[(i + sec) % VARIANTS])
                    if writer.keyframes > before:
                        sizes["keyframes"] += 1
                        sizes["keyframe_bytes"] = len(body)
                    else:
                        sizes["steady_bytes"] += len(body)
                sizes["bytes"] += len(body)
                signer = signers[i]
                await nc.publish(tel[i], body, headers=signer.headers(body) if signer else None)
                sent += 1
            while due and start + due[0][0] <= time.time():
                _, i = due.pop(0)
                node = names[(i * step) % nodes]
                body = _xid(i, node, gpus)
                signer = signers[(i * step) % nodes]
                headers = signer.headers(body) if signer else None
                await nc.publish(subjects.event("xid", node), body, headers=headers)
        await nc.flush()
    await nc.drain()
    if telemetry_format == 1:
        sizes["steady_bytes"] = sizes["bytes"]
    return {"published": sent, "late_s": late, **sizes}


def publisher_main(argv: list[str] | None = None) -> int:
    """The publisher process: URL NODES GPUS WARMUP SECONDS HEALTH."""
    p = argparse.ArgumentParser(prog="gpuops.bench.intake")
    for name, kind in (("url", str), ("nodes", int), ("gpus", int)):
        p.add_argument(name, type=kind)
    for name in ("warmup", "seconds"):
        p.add_argument(name, type=float)
    p.add_argument("health", type=int)
    p.add_argument("--identity-key", type=Path, help="the engine's identity key file")
    p.add_argument("--telemetry-format", type=int, choices=(1, 2), default=2)
    a = p.parse_args(argv)
    identity = a.identity_key.read_text().strip().encode() if a.identity_key else b""
    report = asyncio.run(
        publish(a.url, a.nodes, a.gpus, a.warmup, a.seconds, a.health, identity, a.telemetry_format)
    )
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(publisher_main())
