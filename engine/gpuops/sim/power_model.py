"""Throughput as a function of the power limit and the workload (gpuops/sim/data/power_model.yml).

The simulated fleet uses it for GPUs running a `load` (their power, SM clock, clocks-event
0x4), and `gpuops bench power` for the throughput each policy keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any

import yaml

POWER_CAP = 0x4


@dataclass(frozen=True, slots=True)
class Workload:
    """What runs on a GPU: how hard it pushes power, how much of it is compute."""

    name: str
    intensity: float
    compute_share: float
    util: float


@dataclass(frozen=True, slots=True)
class Point:
    """Where a GPU settles under a limit."""

    power_w: float
    clock_mhz: float
    throughput: float  # of the work's throughput at full clock
    limited: bool  # held by the power cap (clocks-event 0x4)
    util: float


@dataclass(frozen=True, slots=True)
class PowerModel:
    """P(f) = idle + (ref - idle) * intensity * (f / ref_clock)^alpha, see the data file."""

    min_limit_w: float
    max_limit_w: float
    idle_w: float
    ref_w: float
    ref_clock_mhz: float
    max_clock_mhz: float
    min_clock_mhz: float
    cap_margin_w: float
    alpha: float
    workloads: dict[str, Workload]

    def power_at(self, w: Workload, clock_mhz: float) -> float:
        """Board power of the work at an SM clock."""
        ratio = clock_mhz / self.ref_clock_mhz
        return float(self.idle_w + (self.ref_w - self.idle_w) * w.intensity * ratio**self.alpha)

    def at(self, w: Workload, limit_w: float) -> Point:
        """Where the work settles under `limit_w`."""
        full = self.power_at(w, self.max_clock_mhz)
        room = limit_w - self.cap_margin_w
        if w.intensity <= 0 or full <= room:
            return Point(full, self.max_clock_mhz, 1.0, False, w.util)
        dynamic = max(room - self.idle_w, 0.0) / ((self.ref_w - self.idle_w) * w.intensity)
        clock = max(self.min_clock_mhz, self.ref_clock_mhz * dynamic ** (1 / self.alpha))
        share = w.compute_share
        throughput = share * clock / self.max_clock_mhz + (1 - share)
        return Point(self.power_at(w, clock), clock, throughput, True, w.util)

    def workload(self, name: str, intensity: float | None = None) -> Workload:
        """A named workload of the data file, its intensity changed if given."""
        base = self.workloads[name]
        if intensity is None:
            return base
        return Workload(base.name, intensity, base.compute_share, base.util)


def model_from(doc: dict[str, Any]) -> PowerModel:
    """The model of a parsed data file."""
    gpu = {k: float(v) for k, v in doc["gpu"].items() if k != "name"}
    loads = {
        name: Workload(name, float(w["intensity"]), float(w["compute_share"]), float(w["util"]))
        for name, w in doc["workloads"].items()
    }
    return PowerModel(workloads=loads, **gpu)


@cache
def h200_model() -> PowerModel:
    """The shipped model (defaults from the recorded H200 burst)."""
    text = resources.files("gpuops.sim").joinpath("data/power_model.yml").read_text()
    return model_from(yaml.safe_load(text))
