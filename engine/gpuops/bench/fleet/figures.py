"""What `gpuops bench fleet` runs (FleetSpec), what a round measured (RoundFigures), and
how both are reported: lines of figures, a machine-readable line per round, a summary."""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field

from gpuops.errors import EngineError


class BenchError(EngineError):
    """The bench could not run: bad options, a replica that died or never became ready."""


@dataclass(frozen=True, slots=True)
class FleetSpec:
    """What to run: fleet size, replica counts, and the timing of each round."""

    nodes: int = 12_500
    gpus: int = 8
    replicas: tuple[int, ...] = (1, 2, 4)
    seconds: int = 60  # the measured window
    warmup: int = 15
    health: int = 100  # probe failures injected over the window, one node each
    publishers: int = 0  # 0: one per 5,000 nodes, at most one per core
    every: float = 5.0  # seconds between lag lines
    drain_s: float = 60.0
    refresh_s: float = 60.0  # each node's sample is rebuilt from the fleet this often
    nats_replicas: int = 3
    ready_timeout_s: float = 900.0
    telemetry_format: int = 2  # what the publishers send (gpuops.bus.wire)
    telemetry_storage: str = "file"  # nats.telemetry_storage: file or memory
    telemetry_replicas: int = 0  # nats.telemetry_replicas (0: nats_replicas)

    def check(self) -> None:
        """A BenchError for options that cannot make a round."""
        if self.nodes < 1 or self.gpus < 1 or self.seconds < 1 or self.warmup < 0:
            raise BenchError("--nodes, --gpus and --seconds must be >= 1, --warmup >= 0")
        if not self.replicas or min(self.replicas) < 1:
            raise BenchError("--replicas must list counts of at least 1, like 1,2,4")
        if self.health < 0 or self.publishers < 0:
            raise BenchError("--health and --publishers must be >= 0")
        if self.telemetry_format not in (1, 2) or self.telemetry_storage not in ("file", "memory"):
            raise BenchError("--telemetry-format is 1 or 2, --telemetry-storage file or memory")

    def publisher_count(self, cores: int) -> int:
        """How many publisher processes."""
        if self.publishers:
            return min(self.publishers, self.nodes)
        return max(1, min(cores, -(-self.nodes // 5000)))


@dataclass(slots=True)
class RoundFigures:
    """What one round measured. Counts of telemetry are events (one per node and second,
    `gpus` samples each); rates are GPU samples per second."""

    replicas: int
    cores: int
    gpus: int
    window_s: float
    offered: int  # telemetry events the fleet should have sent in the window
    published: int  # of them, sent
    missed: int  # of them, not sent (the publisher was more than a second behind)
    published_total: int  # events sent over the whole run (warm-up and window)
    stored: int  # events the telemetry stream took
    handled_total: int  # events the replicas handled over the whole run
    pending_end: int  # events still unread when the drain gave up (0: drained)
    handled_per_s: list[float]  # samples/s of each replica over the window
    cpu_cores: list[float]  # cores each replica used over the window
    rss_mb: list[float]  # each replica's RSS at the end of the window
    ready_s: list[float]
    max_lag: list[float]  # the most telemetry events a replica was behind, of its lines
    publisher_cores: float
    nats_cores: float
    machine_cores: float  # busy cores of the whole machine (other people's work too)
    load: tuple[float, float]
    health_sent: int
    bytes_total: int = 0  # bytes of telemetry the publishers sent over the whole run
    latencies_ms: list[float] = field(default_factory=list)  # probe failure -> intent
    stored_ms: list[float] = field(default_factory=list)  # of it, until the stream acked

    @property
    def samples_per_s(self) -> float:
        """GPU samples per second all replicas handled over the window."""
        return sum(self.handled_per_s)

    @property
    def published_per_s(self) -> float:
        """GPU samples per second the publishers sent over the window."""
        return self.published * self.gpus / max(self.window_s, 1e-9)

    @property
    def dropped(self) -> int:
        """Events published that no stream stored: core NATS, at most once, drops what
        the servers cannot take (an agent's sample is replaced a second later)."""
        return self.published_total - self.stored

    @property
    def lost(self) -> int:
        """Events the stream stored that no replica handled (dropped by the stream's cap).
        Exact once drained; before, a batch handled but not yet acked counts in both
        handled and pending, so this is then a lower bound."""
        return max(0, self.stored - self.handled_total - self.pending_end)

    def quantile(self, q: int, values: list[float] | None = None) -> float:
        """The q-th percentile of event -> intent latency (or of `values`) in ms, nan
        without any."""
        values = sorted(self.latencies_ms if values is None else values)
        if len(values) < 2:
            return values[0] if values else float("nan")
        return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def round_lines(f: RoundFigures) -> Iterable[str]:
    """The report of one round, the machine-readable line last."""
    g = f.gpus
    yield (
        f"published: {f.published * g:,} of {f.offered * g:,} samples offered in the window "
        f"({f.published / max(1, f.offered):.1%}), {f.missed * g:,} missed (publisher behind); "
        f"{f.published_per_s:,.0f} samples/s"
    )
    yield (
        f"whole run: {f.published_total * g:,} samples published, {f.stored * g:,} stored "
        f"({f.dropped * g:,} dropped by NATS), {f.handled_total * g:,} handled (what a "
        f"takeover decides again counts again), "
        f"{f.pending_end * g:,} unread after the drain, {f.lost * g:,} lost to the stream's cap"
    )
    yield (
        f"wire: {f.bytes_total / max(1, f.published_total * g):,.0f} bytes per GPU sample "
        "(keyframes included)"
    )
    for i, rate in enumerate(f.handled_per_s):
        cpu = f.cpu_cores[i]
        yield (
            f"r{i}: {rate:,.0f} samples/s on {cpu:.2f} cores ({rate / max(cpu, 1e-9):,.0f} per "
            f"cpu-s), max lag {f.max_lag[i]:,.0f} events, RSS {f.rss_mb[i]:,.0f} MB, "
            f"ready in {f.ready_s[i]:.1f}s"
        )
    yield (
        f"health: {f.health_sent} probe failures, {len(f.latencies_ms)} intents; event -> intent "
        f"p50 {f.quantile(50):.1f} ms, p99 {f.quantile(99):.1f} ms, "
        f"max {max(f.latencies_ms, default=float('nan')):.1f} ms; of it, until stored: "
        f"p50 {f.quantile(50, f.stored_ms):.1f} ms, p99 {f.quantile(99, f.stored_ms):.1f} ms"
    )
    yield (
        f"cpu over the window: replicas {sum(f.cpu_cores):.2f}, publishers "
        f"{f.publisher_cores:.2f}, nats-servers {f.nats_cores:.2f}, whole machine "
        f"{f.machine_cores:.2f} of {f.cores} cores; load {f.load[0]:.1f} -> {f.load[1]:.1f}"
    )
    yield figures_line(f)


def figures_line(f: RoundFigures) -> str:
    """The machine-readable line of a round."""
    return (
        f"replicas={f.replicas} cores={f.cores} samples_per_s={f.samples_per_s:.0f} "
        f"per_replica={','.join(f'{r:.0f}' for r in f.handled_per_s)} "
        f"per_replica_per_core={f.samples_per_s / f.replicas / f.cores:.0f} "
        f"published_per_s={f.published_per_s:.0f} "
        f"missed={f.missed * f.gpus} dropped={f.dropped * f.gpus} lost={f.lost * f.gpus} "
        f"p50_ms={f.quantile(50):.1f} p99_ms={f.quantile(99):.1f} "
        f"rss_mb={','.join(f'{m:.0f}' for m in f.rss_mb)}"
    )


def summary_lines(rounds: list[RoundFigures]) -> Iterable[str]:
    """One row per round: throughput, efficiency, latency, memory."""
    yield "replicas  samples/s  per replica  /replica/core  per cpu-s  p50 ms  p99 ms  RSS MB"
    for f in rounds:
        used = sum(f.cpu_cores)
        yield (
            f"{f.replicas:>8}  {f.samples_per_s:>9,.0f}  {f.samples_per_s / f.replicas:>11,.0f}  "
            f"{f.samples_per_s / f.replicas / f.cores:>13,.0f}  "
            f"{f.samples_per_s / max(used, 1e-9):>9,.0f}  {f.quantile(50):>6.1f}  "
            f"{f.quantile(99):>6.1f}  {max(f.rss_mb, default=0):>6,.0f}"
        )
