"""`gpuops bench replay`: CPU per GPU sample of `gpuops replay` (the live engine's code on
memory stores) on a recording of the simulated H200 fleet, with 1 and N rules, and how
much of it is decoding the events (the intake's `decode`).

The recording is built once: `--gpus` GPU samples as 8-GPU telemetry events of a fleet
stepping every 10 s. Each round replays it through a fresh shadow engine, rule counts
interleaved, `--repeat` rounds; the figures are medians. With `--inventory none` the
recording is the only list of nodes, as `gpuops replay` without `--inventory` runs.
"""

from __future__ import annotations

import asyncio
import json
import math
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from gpuops.bench.rules import bench_ruleset
from gpuops.intake.decode import decode
from gpuops.settings import Settings
from gpuops.sim.fleet import SimFleet
from gpuops.spine.heap import settle_heap
from gpuops.spine.replay import replay

GPUS_PER_NODE = 8
STEP_S = 10.0
T0 = 1_900_000_000.0


def record(
    root: Path, gpus: int, steps: int = 10, step_s: float = STEP_S
) -> tuple[Path, Path, int]:
    """A recording of about `gpus` GPU samples, `steps` a node `step_s` apart; its path,
    the fleet's inventory, samples."""
    nodes = max(1, math.ceil(gpus / GPUS_PER_NODE / steps))
    fleet = SimFleet.create(root / "sim", nodes=nodes, gpus=GPUS_PER_NODE)
    for node in fleet.nodes:
        fleet.inject(node, "load", 0, workload="training")
    path, samples = root / "recording.jsonl", 0
    with path.open("w") as out:
        for step in range(steps):
            for node in fleet.nodes:
                sample = fleet.telemetry(node, T0 + step * step_s)
                if sample is not None:
                    out.write(json.dumps(sample, separators=(",", ":")) + "\n")
                    samples += len(sample["data"]["gpus"])
    return path, fleet.root / "inventory", samples


def _round(path: Path, n_rules: int, inventory: Path | None) -> tuple[float, float]:
    """CPU and wall seconds of one replay."""
    rules = bench_ruleset(n_rules)
    settings = Settings(safety={"stale_after_s": float("inf")})  # type: ignore[arg-type]
    settle_heap()  # as `gpuops replay` does before its replay
    cpu, wall = time.process_time(), time.perf_counter()
    asyncio.run(replay(path, rules, inventory, settings))
    return time.process_time() - cpu, time.perf_counter() - wall


def _decode_cpu(path: Path) -> float:
    cpu = time.process_time()
    with path.open("rb") as lines:
        for line in lines:
            decode(line)
    return time.process_time() - cpu


def bench_replay(gpus: int, rules: int, repeat: int, with_inventory: bool) -> Iterator[str]:
    """Figures, one line each."""
    with tempfile.TemporaryDirectory(prefix="gpuops-bench-replay-") as held:
        path, inventory, samples = record(Path(held), gpus)
        events = sum(1 for _ in path.open())
        yield (
            f"recording: {samples} GPU samples in {events} telemetry events "
            f"({path.stat().st_size / samples:.0f} bytes a GPU sample), "
            f"inventory {'given' if with_inventory else 'none (the recording names the nodes)'}"
        )
        counts = sorted({1, rules})
        runs: dict[int, list[tuple[float, float]]] = {n: [] for n in counts}
        for _ in range(repeat):
            for n in counts:
                runs[n].append(_round(path, n, inventory if with_inventory else None))
        decoding = statistics.median(_decode_cpu(path) for _ in range(repeat))
        for n in counts:
            cpu = statistics.median(c for c, _ in runs[n])
            wall = statistics.median(w for _, w in runs[n])
            yield (
                f"replay, {n} rule{'s' if n > 1 else ''}: {samples / cpu:,.0f} GPU samples per "
                f"CPU-second ({cpu / samples * 1e6:.1f} us each; wall {wall:.2f} s; "
                f"median of {repeat})"
            )
        yield (
            f"decoding alone (the intake's decode, once per event): "
            f"{decoding / samples * 1e6:.1f} us a GPU sample"
        )
