"""The agent's quick checks as a node health check: Slurm's HealthCheckProgram, or NHC's.

Slurm runs `HealthCheckProgram` on every node at slurmd's start and every
`HealthCheckInterval`; the program drains the node itself when a check fails (as LBNL's
NHC does). `gpuops agent --health-check` is such a program: one NVML reading, checked for
what makes a node unfit for new work, each finding printed as NHC prints its own
(`ERROR: gpuops: ...`), exit 1 when any. With `--drain-in-slurm` it also drains the node,
with the reason `gpuops health: ...` (a gpuops reason: the engine's return_to_service.yml
may resume it once the node's probe passed), and never over a drain that is already there
(a person's reason stays). The checks are only those a single reading decides; what needs
time (temperature trends, ECC rates, zombie GPUs) stays with the engine's rules.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gpuops.agent.backend import GpuBackend
from gpuops.errors import ActionError

HEALTH_REASON = "gpuops health"
SCONTROL_TIMEOUT_S = 20.0


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
    """The Slurm reason: gpuops's, the first finding, and how many more (Slurm shows one line)."""
    first = found[0]
    where = "" if first.gpu is None else f"GPU {first.gpu}: "
    more = f" (+{len(found) - 1} more)" if len(found) > 1 else ""
    return f"{HEALTH_REASON}: {where}{first.text}{more}"[:250]


def drain_in_slurm(node: str, why: str, scontrol: str = "scontrol") -> str:
    """Drain `node` for `why` unless it is drained already; what was done, for the log."""
    shown = _scontrol(scontrol, "show", "node", "-o", node)
    state = next((w[6:] for w in shown.split() if w.startswith("State=")), "")
    if "DRAIN" in state:
        return f"{node} is drained already ({state}): its reason is kept"
    _scontrol(scontrol, "update", f"nodename={node}", "state=drain", f"reason={why}")
    return f"drained {node} in Slurm: {why}"


def _scontrol(scontrol: str, *args: str) -> str:
    done = subprocess.run(
        [scontrol, *args], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S, check=False
    )
    if done.returncode != 0:
        why = done.stderr.strip() or done.stdout.strip()
        raise ActionError(f"scontrol {args[0]} failed: {why}")
    return done.stdout


def check(
    backend: GpuBackend,
    node: str,
    expect_gpus: int | None = None,
    drain: bool = False,
    scontrol: str = "scontrol",
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
    lines = [f.line() for f in found]
    if drain:
        lines.append(f"gpuops: {drain_in_slurm(node, reason(found), scontrol)}")
    return lines, 1
