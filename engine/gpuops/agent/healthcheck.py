"""The agent's quick checks as a node health check: Slurm's HealthCheckProgram, or NHC's.

Slurm runs `HealthCheckProgram` on every node at slurmd's start and every
`HealthCheckInterval`, and NHC runs its checks the same way. `gpuops agent --health-check`
is such a check: one NVML reading, checked for what makes a node unfit for new work, each
finding printed as NHC prints its own (`ERROR: gpuops: ...`), exit 1 when any.

It reports and never drains. A drain gpuops makes is the engine's decision, signed, under
the node lock, the fleet breaker and the audit: a check that drained by itself on every
node would take the whole fleet out on one bad driver roll-out (persistence off
everywhere), past the breaker that exists for exactly that. The running agent publishes
the same readings, and the engine's rules act on them. The checks are only those a single
reading decides; what needs time (temperature trends, ECC rates, zombie GPUs) stays with
the engine's rules.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gpuops.agent.backend import GpuBackend

HEALTH_REASON = "gpuops health"


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing that makes the node unfit; `gpu` None for the node as a whole."""

    gpu: int | None
    text: str

    def line(self) -> str:
        """As NHC prints a failed check."""
        where = "" if self.gpu is None else f"GPU {self.gpu}: "
        return f"ERROR: gpuops: {where}{self.text}"


GpuCheck = Callable[[dict[str, Any]], str | None]


def _remap_failed(g: dict[str, Any]) -> str | None:
    return "row remapping failed: the GPU needs replacing" if g.get("remap_failure") else None


def _remap_pending(g: dict[str, Any]) -> str | None:
    return "a row remap is pending: the GPU needs a reset" if g.get("remap_pending") else None


def _uncorrectable(g: dict[str, Any]) -> str | None:
    count = g.get("ecc_dbe_volatile") or 0
    return f"{count} uncorrectable ECC errors since the driver loaded" if count > 0 else None


def _ecc_off(g: dict[str, Any]) -> str | None:
    return "ECC is off: memory errors go unseen" if g.get("ecc_mode") is False else None


def _persistence_off(g: dict[str, Any]) -> str | None:
    return "persistence mode is off" if g.get("persistence_mode") is False else None


def _pcie_narrow(g: dict[str, Any]) -> str | None:
    # Width, not generation: an idle GPU lowers its PCIe generation by design, never its width.
    width, full = g.get("pcie_width"), g.get("pcie_max_width")
    if width is None or full is None or width >= full:
        return None
    return f"PCIe link is x{width} of x{full}"


CHECKS: tuple[GpuCheck, ...] = (
    _remap_failed,
    _remap_pending,
    _uncorrectable,
    _ecc_off,
    _persistence_off,
    _pcie_narrow,
)


def findings(
    gpus: list[dict[str, Any]], lost: Iterable[int], expect_gpus: int | None
) -> list[Finding]:
    """What one reading says is wrong: the GPU count, lost GPUs, then each GPU's checks."""
    out: list[Finding] = []
    if expect_gpus is not None and len(gpus) != expect_gpus:
        out.append(Finding(None, f"{len(gpus)} GPUs answer, {expect_gpus} expected"))
    out += [Finding(index, "fell off the bus (NVML lost it)") for index in sorted(set(lost))]
    for g in gpus:
        out += [Finding(g["index"], text) for check in CHECKS if (text := check(g)) is not None]
    return out


def reason(found: list[Finding]) -> str:
    """One line for a log or NHC's reason: the first finding, and how many more."""
    first = found[0]
    where = "" if first.gpu is None else f"GPU {first.gpu}: "
    more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
    return f"{HEALTH_REASON}: {where}{first.text}{more}"[:250]


def check(
    backend: GpuBackend,
    node: str,
    expect_gpus: int | None = None,
) -> tuple[list[str], int]:
    """One reading checked: the lines to print and the exit status (0 fit, 1 not)."""
    try:
        gpus, signals = backend.sample()
    finally:
        backend.close()
    lost = [int(s.data["gpu"]) for s in signals if s.kind == "gpu_lost" and "gpu" in s.data]
    found = findings(gpus, lost, expect_gpus)
    if not found:
        return [f"gpuops: {node}: {len(gpus)} GPUs pass"], 0
    return [f.line() for f in found] + [f"gpuops: {node}: {reason(found)}"], 1
