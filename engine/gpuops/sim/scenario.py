"""Fault scenarios as YAML timelines (see gpuops/sim/scenarios/)."""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from gpuops.errors import ConfigError
from gpuops.match.durations import parse_duration

FAULTS = (
    "overheat",
    "power_limit",
    "xid",
    "zombie",
    "drift",
    "silent",
    "ecc",
    "busy",
    "job",
    "pod",
    "load",  # steady work on the power model: {workload: training|inference|idle}
    "bw_collapse",  # the interconnect and bandwidth faults: gpuops/sim/interconnect.py
    "nvlink_down",
    "ib_down",
    "ib_errors",
    "slow_d2d",  # the diagnostic tools' faults: gpuops/sim/diag_shims.py
    "dcgm_fail",
    "pcie_narrow",
    "bad_hca",
    "pcie_slow",  # topology: a link below Gen5 under load, a GPU on another NUMA node
    "numa",
    "dra_taint",  # the Kubernetes DRA driver's health taint on the GPU's device
)
# Running work rather than a fault: a Slurm job or a Kubernetes pod, with what each takes.
WORK_PARAMS = {
    "job": {"id", "name", "duration", "gpus"},
    "pod": {"name", "namespace", "grace", "pdb", "duration", "gpus"},
}


@dataclass(frozen=True, slots=True)
class Fault:
    """One fault on one node (and GPU) at a simulated time."""

    at: float
    fault: str
    node: str
    gpu: int = 0
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Said:
    """A command a person gives at a simulated time (`power budget rack-a4 14kW 3m`)."""

    at: float
    command: str


@dataclass(frozen=True, slots=True)
class Scenario:
    """A named timeline of faults, and of commands people give."""

    name: str
    description: str
    faults: tuple[Fault, ...]
    commands: tuple[Said, ...] = ()


def load_scenario(name_or_path: str, nodes: list[str]) -> Scenario:
    """A shipped scenario by name (demo, storm) or a YAML file, resolved against `nodes`."""
    path = Path(name_or_path)
    if path.suffix in (".yml", ".yaml") and path.exists():
        text = path.read_text(encoding="utf-8")
    else:
        shipped = resources.files("gpuops.sim").joinpath(f"scenarios/{name_or_path}.yml")
        if not shipped.is_file():
            raise ConfigError(
                f"no scenario {name_or_path!r} (shipped: demo, storm, peak; or a .yml path)"
            )
        text = shipped.read_text(encoding="utf-8")
    doc = yaml.safe_load(text)
    faults: list[Fault] = []
    for raw in doc.get("faults", []):
        faults.extend(_faults(raw, nodes))
    said = [
        Said(parse_duration(c.get("at", 0)), str(c["command"]))
        for c in doc.get("commands", [])
        if isinstance(c, dict) and c.get("command")
    ]
    return Scenario(
        str(doc.get("name", name_or_path)),
        str(doc.get("description", "")),
        tuple(sorted(faults, key=lambda f: f.at)),
        tuple(sorted(said, key=lambda c: c.at)),
    )


def _faults(raw: dict[str, Any], nodes: list[str]) -> list[Fault]:
    kind = raw.get("fault")
    if kind not in FAULTS:
        raise ConfigError(f"unknown fault {kind!r}; known: {', '.join(FAULTS)}")
    at = parse_duration(raw.get("at", 0))
    params = {k: v for k, v in raw.items() if k not in ("at", "fault", "node", "gpu", "share")}
    if kind in WORK_PARAMS:
        check_work(kind, params)
    gpu = int(raw.get("gpu", 0))
    if "share" in raw:  # a storm: the first share of the fleet, a little apart
        count = max(1, round(len(nodes) * float(raw["share"])))
        return [Fault(at + i * 0.2, kind, n, gpu, params) for i, n in enumerate(nodes[:count])]
    return [Fault(at, kind, _node(raw.get("node", 1), nodes), gpu, params)]


def check_work(kind: str, params: dict[str, Any]) -> None:
    """Refuse a job or pod entry with unknown keys or durations that are not durations."""
    unknown = sorted(set(params) - WORK_PARAMS[kind])
    if unknown:
        known = ", ".join(sorted(WORK_PARAMS[kind]))
        raise ConfigError(f"{kind}: unknown key(s) {', '.join(unknown)}; known: {known}")
    for key in ("duration", "grace"):
        if key in params:
            try:
                parse_duration(params[key])
            except ValueError as exc:
                raise ConfigError(f"{kind}: {key}: {exc}") from exc


def _node(ref: Any, nodes: list[str]) -> str:
    if isinstance(ref, int):
        if not 1 <= ref <= len(nodes):
            raise ConfigError(f"node index {ref} outside a fleet of {len(nodes)}")
        return nodes[ref - 1]
    if ref not in nodes:
        raise ConfigError(f"node {ref!r} is not in the fleet")
    return str(ref)
