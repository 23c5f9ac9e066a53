"""MIG on the H200 141 GB: its GPU-instance profiles, reading `nvidia-smi mig -lgi`, and
the layout that fits a workload (what `gpuops report density` recommends).

Profiles are those `nvidia-smi mig -lgi-profiles` lists on the recorded board: an
instance takes memory slices (8 on the GPU) and compute slices (7).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class Profile:
    id: int
    name: str
    memory_slices: int
    compute_slices: int
    memory_gb: float


H200_PROFILES: tuple[Profile, ...] = (
    Profile(19, "1g.18gb", 1, 1, 18.0),
    Profile(20, "1g.18gb+me", 1, 1, 18.0),
    Profile(15, "1g.35gb", 2, 1, 35.0),
    Profile(14, "2g.35gb", 2, 2, 35.0),
    Profile(9, "3g.71gb", 4, 3, 71.0),
    Profile(5, "4g.71gb", 4, 4, 71.0),
    Profile(0, "7g.141gb", 8, 7, 141.0),
)
BY_ID: dict[int, Profile] = {p.id: p for p in H200_PROFILES}
MEMORY_SLICES = 8
COMPUTE_SLICES = 7

# A row of the `-lgi` table: "|   0  MIG 3g.71gb   9   1   4:4 |" (GPU, name, profile id,
# instance id, placement).
_LGI_ROW = re.compile(r"^\|\s*\d+\s+MIG\s+\S+\s+(\d+)\s+\d+\s+\d+:\d+")


def parse_lgi(text: str) -> list[int]:
    """The profile ids of the GPU instances `nvidia-smi mig -lgi` lists, in its order."""
    return [int(m.group(1)) for line in text.splitlines() if (m := _LGI_ROW.match(line))]


def fits(profiles: list[int]) -> bool:
    """Whether a layout fits one GPU: its slices add up to at most the GPU's."""
    chosen = [BY_ID[p] for p in profiles]
    return (
        sum(p.memory_slices for p in chosen) <= MEMORY_SLICES
        and sum(p.compute_slices for p in chosen) <= COMPUTE_SLICES
    )


@dataclass(frozen=True)
class Recommendation:
    """What to do with an under-used GPU."""

    kind: str  # "mig", "time-slicing" or "none"
    profiles: tuple[int, ...] = ()
    replicas: int = 0
    why: str = ""

    def describe(self) -> str:
        if self.kind == "mig":
            names = ", ".join(BY_ID[p].name for p in self.profiles)
            return f"MIG {list(self.profiles)} ({names})"
        if self.kind == "time-slicing":
            return f"time-slicing x{self.replicas}"
        return "keep whole"


def recommend(
    p95_util: float, mem_used_bytes: float, *, headroom: float = 1.25, development: bool = False
) -> Recommendation:
    """The layout for a GPU whose busiest 5% of samples reach `p95_util` percent and whose
    memory peaks at `mem_used_bytes`.

    One workload of that size needs an instance with enough memory (with headroom) and
    enough compute slices to carry its p95 load; the layout is as many instances of the
    smallest such profile as fit, so the GPU carries that many such workloads. A
    development pool is time-sliced instead (no isolation needed, no reconfiguration).
    """
    need_gb = max(mem_used_bytes, 0.0) * headroom / 1e9
    need_slices = max(1, math.ceil(max(p95_util, 0.0) / 100.0 * COMPUTE_SLICES * headroom))
    if development:
        replicas = max(1, min(8, math.floor(100.0 / max(p95_util * headroom, 1.0))))
        why = f"development pool: p95 {p95_util:.0f}% fits {replicas} sharing one GPU"
        return Recommendation("time-slicing", replicas=replicas, why=why)
    for profile in sorted(H200_PROFILES, key=lambda p: (p.compute_slices, p.memory_slices)):
        if profile.name.endswith("+me") or profile.memory_gb < need_gb:
            continue
        if profile.compute_slices < need_slices:
            continue
        count = min(
            MEMORY_SLICES // profile.memory_slices, COMPUTE_SLICES // profile.compute_slices
        )
        if count < 2:
            break  # one instance of the whole GPU is no gain
        why = (
            f"p95 {p95_util:.0f}% needs {need_slices} of 7 compute slices, "
            f"{need_gb:.0f} GB with headroom: {count} x {profile.name}"
        )
        return Recommendation("mig", profiles=(profile.id,) * count, why=why)
    return Recommendation("none", why="the workload needs most of the GPU")
