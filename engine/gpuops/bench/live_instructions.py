"""`gpuops bench instructions --live`: what the live engine costs a GPU sample against
`gpuops replay` of the same samples, in instructions.

`gpuops bench intake` times the live engine beside a publisher and a nats-server on the
same cores: on a shared 2-core VM their work, and the neighbours', moves its CPU per
sample by a third between runs and inflates live against the replay it times alone
afterwards. This bench counts instructions instead (valgrind's callgrind), which move
by a percent or two, so the live/replay ratio it prints is the code's own.

A recording of the simulated H200 fleet at 1 Hz (v2 JSON, as agents write it; a node's
keyframe every `wire.KEYFRAME_EVERY_S`) is
- replayed (`gpuops replay`: the shipped rules, the fleet's inventory, memory stores),
  and
- published, each sample with its node's MAC, to a real nats-server, then read by the
  live engine (role `engine`: its partitions' intakes, leases, KV, the console's table),
  which pulls `--batch` messages at a time as it does at steady state (`bench intake`
  at 8,000 GPUs reads about 6 a pull): the backlog keeps every pull full, so no pull
  lingers. Under callgrind the engine runs some SLOWDOWN times slower, so its intakes'
  slice (`consumer.SLICE_S`, after which telemetry gives the loop a turn) is made as
  much longer: a turn every few messages, as at full speed, not one after each.
Its leases, on wall time, last 300 s (at 10 s one ran out during a full batch and the
batch was read again): the bench fails when a partition was taken over twice.
Each under callgrind, net of the same process on nothing: the replay on an empty file,
the engine on an empty stream held for as long as the full run took to drain its
stream (its timers, heartbeats and leases then cost both runs alike). The engine's
clock is set to the recording's end: the samples are as fresh to it as to the replay.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpuops import shipped, subjects
from gpuops.bench.instructions import callgrind
from gpuops.bench.replay import GPUS_PER_NODE, T0, record
from gpuops.bench.rulebook import samples
from gpuops.bus import wire
from gpuops.errors import ConfigError

STEP_S = 1.0  # the live engine's cadence: a sample a node a second
DRAIN_POLL_S = 0.5  # how often the engine under callgrind looks whether it is done
# How much slower the engine runs under callgrind than at full speed (a replay of this
# bench's 18,240 GPU samples: 0.23 s alone, 11.1 s under it).
SLOWDOWN = 50.0
STUCK_S = 120.0  # handling nothing this long (under callgrind), it is not going to finish

_REPLAY = (
    "import sys; from gpuops.bench.live_instructions import replay_main; "
    "replay_main(sys.argv[1], sys.argv[2])"
)
_LIVE = "import sys; from gpuops.bench.live_instructions import live_main; live_main(sys.argv[1])"


def bench_live_instructions(gpus: int, seconds: int, partitions: int, batch: int) -> Iterator[str]:
    """Figures, one line each: about `gpus` GPU samples, `seconds` of each node's."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise ConfigError("bench instructions runs under valgrind: install it (Debian: valgrind)")
    with tempfile.TemporaryDirectory(prefix="gpuops-bench-live-") as held:
        work = Path(held)
        recording, inventory, n = record(work, gpus, seconds, STEP_S)
        v2, empty = work / "v2.jsonl", work / "empty.jsonl"
        samples(recording, v2)
        empty.write_text("")
        lines = sum(1 for _ in v2.open("rb"))
        yield (
            f"samples: {n:,} GPU samples ({lines:,} v2 lines: {lines // seconds} nodes x "
            f"{GPUS_PER_NODE} GPUs at 1 Hz for {seconds} s), the shipped rules and the fleet's "
            "inventory; callgrind, PYTHONHASHSEED=0, each net of the same process on nothing"
        )
        replay = (
            _count(valgrind, [_REPLAY, str(v2), str(inventory)])
            - _count(valgrind, [_REPLAY, str(empty), str(inventory)])
        ) / n
        yield f"replay: {replay:,.0f} instructions a GPU sample"
        spec = {"inventory": str(inventory), "partitions": partitions, "batch": batch}
        spec["clock"] = T0 + seconds * STEP_S
        full, drained_s = _live(valgrind, work / "full", {**spec, "lines": lines}, v2)
        idle, _ = _live(valgrind, work / "idle", {**spec, "lines": 0, "hold_s": drained_s}, None)
        live = (full - idle) / n
        yield (
            f"live: {live:,.0f} instructions a GPU sample ({partitions} partitions, "
            f"{batch} messages a pull; drained in {drained_s:.0f} s under callgrind)"
        )
        yield f"live/replay: {live / replay:.2f}"


def _count(valgrind: str, argv: list[str]) -> int:
    """Instructions of `python -c argv...` under callgrind."""
    return callgrind(valgrind, [sys.executable, "-c", *argv], dict(os.environ))[0]


def _live(valgrind: str, work: Path, spec: dict[str, Any], v2: Path | None) -> tuple[int, float]:
    """Instructions of the engine reading what `v2` holds (None: nothing) from its own
    nats-server, and the seconds it took to drain it."""
    from gpuops.bus.server import EmbeddedNats

    work.mkdir()
    server = EmbeddedNats(work / "nats").start()
    try:
        spec = {**spec, "url": server.url, "work": str(work)}
        asyncio.run(_publish(spec, v2.read_bytes().splitlines() if v2 is not None else []))
        argv = [sys.executable, "-c", _LIVE, json.dumps(spec)]
        count, printed = callgrind(valgrind, argv, dict(os.environ))
        return count, _drained(printed)
    finally:
        server.stop()


def _settings(spec: dict[str, Any]) -> Any:
    """The bench intake's engine settings, pulling `batch` at a time; staleness off, as
    the replay has it (the recording's time is the engine's clock's)."""
    from gpuops.bench.intake import _settings as intake_settings

    s = intake_settings(Path(spec["work"]), spec["url"], spec["partitions"])
    return s.model_copy(
        update={
            "inventory": Path(spec["inventory"]),
            "intake_batch": spec["batch"],
            "safety": s.safety.model_copy(update={"stale_after_s": float("inf")}),
            # Leases run on wall time: at callgrind's pace a 10 s lease ran out while an
            # intake worked a full batch of 256, and the batch was read again.
            "nats": s.nats.model_copy(update={"lease_s": 300.0}),
        }
    )


async def _publish(spec: dict[str, Any], lines: list[bytes]) -> None:
    """The streams made, and every v2 line published on its node's subject with its
    node's MAC, as agents sign them."""
    from gpuops.bus.conn import connect, ensure_streams
    from gpuops.bus.identity import KeyRing
    from gpuops.spine.app import identity_key

    settings = _settings(spec)
    bus = await connect(spec["url"], settings.nats)
    try:
        await ensure_streams(bus.js, settings.nats)
        keys = KeyRing(identity_key(settings))
        for line in lines:
            node = wire.node_of(line)
            signed = keys.node(node).headers(line)
            await bus.js.publish(subjects.telemetry(node), line, headers=signed)
    finally:
        await bus.close()


def live_main(spec_json: str) -> None:
    """The engine under callgrind: run until it has handled `lines` telemetry events, or
    for `hold_s` when there are none; print the seconds that took."""
    asyncio.run(_run_engine(json.loads(spec_json)))


async def _run_engine(spec: dict[str, Any]) -> None:
    from gpuops.bus.conn import connect
    from gpuops.clock import ManualClock
    from gpuops.intake import consumer
    from gpuops.inventory.hosts import load_inventory
    from gpuops.match.loader import load_rules
    from gpuops.spine.app import App
    from gpuops.spine.heap import settle_heap

    # Callgrind runs the engine some fifty times slower: its telemetry intakes give the
    # loop a turn as often per message as at full speed, not after every message.
    consumer.SLICE_S *= spec.get("slowdown", SLOWDOWN)
    settings = _settings(spec)
    inventory = load_inventory(Path(spec["inventory"]))
    rules = load_rules([settings.rules_dir], settings.playbooks_dir, inventory)
    bus = await connect(spec["url"], settings.nats)
    clock = ManualClock(spec["clock"])
    app = App(settings=settings, bus=bus, clock=clock, rules=rules, inventory=inventory)
    settle_heap()
    began = time.monotonic()
    engine = asyncio.create_task(app.run())
    stuck_s = spec.get("stuck_s", STUCK_S)
    handled = await _drain(engine, app.engine.metrics.events, spec["lines"], stuck_s)
    took = time.monotonic() - began
    if spec["lines"] == 0:
        await asyncio.sleep(spec["hold_s"])
    app.stop.set()
    await engine  # raises what stopped it early
    await bus.close()
    if handled < spec["lines"]:
        raise SystemExit(
            f"the engine handled {handled:.0f} of {spec['lines']} telemetry events and then "
            f"nothing for {stuck_s:.0f} s (its log says why: dead letters, a refused sample)"
        )
    # A partition taken over again (a lease lost) reads its unacked batch twice: the
    # count would be of more work than the samples'.
    takeovers = app.engine.metrics.registry.get_sample_value("gpuops_takeover_seconds_count")
    if takeovers != spec["partitions"]:
        raise SystemExit(
            f"{takeovers:.0f} takeovers of {spec['partitions']} partitions: a lease was lost "
            "and batches were read again"
        )
    print(f"drained {took}", flush=True)


async def _drain(engine: asyncio.Task[None], events: Any, lines: int, stuck_s: float) -> float:
    """Wait until the engine has handled `lines` telemetry events, it stopped, or it
    handled none for `stuck_s`; how many it handled."""
    from gpuops.record.metrics import total

    handled, moved = 0.0, time.monotonic()
    while handled < lines and not engine.done() and time.monotonic() - moved < stuck_s:
        await asyncio.sleep(DRAIN_POLL_S)
        now = total(events, "telemetry")
        if now != handled:
            handled, moved = now, time.monotonic()
    return handled


def replay_main(path: str, inventory: str) -> None:
    """`gpuops replay` of `path` with the shipped rules and the inventory, as the live
    engine has them."""
    from gpuops.inventory.hosts import load_inventory
    from gpuops.match.loader import load_rules
    from gpuops.settings import Settings
    from gpuops.spine.heap import settle_heap
    from gpuops.spine.replay import replay

    hosts = load_inventory(Path(inventory))
    settings = Settings(safety={"stale_after_s": float("inf")})  # type: ignore[arg-type]
    rules = load_rules([shipped.shipped("rules")], shipped.shipped("playbooks"), hosts)
    settle_heap()
    _, report = asyncio.run(replay(Path(path), rules, Path(inventory), settings))
    if report.refusals():  # a refused line would make replay look cheaper than it is
        raise SystemExit(f"replay refused lines of {path}: {report.refusals()}")


def _drained(stdout: bytes) -> float:
    """The seconds the engine said it took to drain its stream."""
    for line in stdout.decode(errors="replace").splitlines():
        if line.startswith("drained "):
            return float(line.split()[1])
    raise ConfigError("the engine under callgrind did not say when it had drained its stream")
