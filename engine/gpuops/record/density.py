"""Who uses their GPUs: a day of utilisation and memory per GPU, kept by the engine for
`gpuops report density` (and ChatOps `density`).

GPUs whose p95 utilisation over the day stays under a threshold are the fleet's waste;
each gets a recommended MIG layout for its workload (gpuops/record/mig.py), or time-slicing in
a development pool. The same bounded window series the rule language uses for
`p95(util_gpu, 24h)` hold the day (gpuops/match/aggregates.py): a few kilobytes per GPU.
A day needs no per-second resolution, so a GPU's sample is taken at most once per
`every_s`, which keeps the cost per telemetry sample near nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from gpuops.match.aggregates import Series
from gpuops.match.facts import Telemetry, as_telemetry
from gpuops.models import Event
from gpuops.record import mig

DAY_S = 86400.0


@dataclass(slots=True)
class _Gpu:
    util: Series
    mem: Series
    first: float
    last: float
    mem_total: float | None = None


@dataclass(frozen=True, slots=True)
class DensityRow:
    """One under-used GPU and what to do with it."""

    node: str
    gpu: int
    hours: float  # how much of the window the engine has seen
    p50: float
    p95: float
    peak: float
    mem_peak_bytes: float
    mem_total_bytes: float | None
    recommendation: mig.Recommendation


@dataclass
class DensityTracker:
    """Per GPU, the utilisation and memory of the last `window_s`, sampled every `every_s`."""

    window_s: float = DAY_S
    every_s: float = 60.0
    gpus: dict[tuple[str, int], _Gpu] = field(default_factory=dict)
    # Per node: when its first GPU is next due, and how many GPUs it had. Most samples
    # come before that and cost one lookup; a node that gains GPUs, or has one without a
    # utilisation reading, is looked at again at its next sample.
    _due: dict[str, tuple[float, int]] = field(default_factory=dict, init=False, repr=False)

    def observe(self, event: Event | Telemetry) -> None:
        """Take a telemetry event's readings (others are not about utilisation)."""
        telemetry = as_telemetry(event)
        if telemetry is None:
            return
        t, node, facts = telemetry.epoch, telemetry.node, telemetry.facts
        due = self._due.get(node)
        if due is not None and t < due[0] and len(facts) <= due[1]:
            return
        first_due = float("inf")
        for fact in facts:
            util = fact["util_gpu"]
            if util is None:
                first_due = t  # a GPU without a reading: the node's next sample is looked at
                continue
            key = (node, fact["index"])
            seen = self.gpus.get(key)
            if seen is None:
                seen = _Gpu(Series(self.window_s, True), Series(self.window_s, False), t, t)
                self.gpus[key] = seen
            elif t - seen.last < self.every_s:
                first_due = min(first_due, seen.last + self.every_s)
                continue
            seen.last = t
            first_due = min(first_due, t + self.every_s)
            seen.util.add(t, util)
            if fact["mem_used_bytes"] is not None:
                seen.mem.add(t, float(fact["mem_used_bytes"]))
            if fact["mem_total_bytes"] is not None:
                seen.mem_total = float(fact["mem_total_bytes"])
        self._due[node] = (first_due, len(facts))

    def sweep(self, now: float) -> int:
        """Forget GPUs not seen for a whole window (a node that left the fleet)."""
        gone = [k for k, g in self.gpus.items() if now - g.last > self.window_s]
        for key in gone:
            del self.gpus[key]
        for node in {node for node, _ in gone} - {node for node, _ in self.gpus}:
            self._due.pop(node, None)
        return len(gone)

    def underused(
        self, threshold: float, development: Callable[[str], bool] = lambda node: False
    ) -> list[DensityRow]:
        """GPUs whose p95 utilisation over the window is under `threshold` percent."""
        rows = []
        for (node, gpu), seen in sorted(self.gpus.items()):
            p95 = seen.util.value("p95")
            if p95 is None or p95 >= threshold:
                continue
            mem_peak = seen.mem.value("max") or 0.0
            rows.append(
                DensityRow(
                    node=node,
                    gpu=gpu,
                    hours=min(seen.last - seen.first, self.window_s) / 3600.0,
                    p50=seen.util.value("p50") or 0.0,
                    p95=p95,
                    peak=seen.util.value("max") or 0.0,
                    mem_peak_bytes=mem_peak,
                    mem_total_bytes=seen.mem_total,
                    recommendation=mig.recommend(p95, mem_peak, development=development(node)),
                )
            )
        return rows


def render(rows: list[DensityRow], threshold: float, tracked: int) -> str:
    """The report as lines for chat and terminal."""
    head = f"{len(rows)} of {tracked} GPUs under {threshold:g}% p95 utilisation over the day"
    lines = [head]
    for r in rows:
        partial = "" if r.hours >= 23.5 else f" (seen {r.hours:.1f} h)"
        mem = f"{r.mem_peak_bytes / 1e9:.0f} GB"
        if r.mem_total_bytes:
            mem += f" of {r.mem_total_bytes / 1e9:.0f}"
        lines.append(
            f"  {r.node} GPU {r.gpu}: util p50 {r.p50:.0f}% p95 {r.p95:.0f}% max {r.peak:.0f}%, "
            f"memory peak {mem}{partial} -> {r.recommendation.describe()}: "
            f"{r.recommendation.why}"
        )
    return "\n".join(lines)
