"""The simulated node as an agent backend: the same interface as NVML."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from gpuops.agent.backend import HealthSignal
from gpuops.sim import state as node_state
from gpuops.sim.fleet import SimFleet
from gpuops.sim.state import SIM_PCI_BUSES


class SimBackend:
    """Reads one node of a simulated fleet (created by `gpuops simulate`)."""

    def __init__(self, fleet_root: Path, node: str) -> None:
        nodes = sorted(p.name for p in (fleet_root / "nodes").iterdir())
        if node not in nodes:
            raise ValueError(f"{node} is not a node of the simulated fleet at {fleet_root}")
        gpus = len(node_state.read(fleet_root / "nodes" / node)["gpus"])
        self.fleet = SimFleet(root=fleet_root, nodes=nodes, gpus=gpus)
        self.node = node
        self._lost: set[int] = set()

    def gpu_count(self) -> int:
        return self.fleet.gpus

    def sample(self) -> tuple[list[dict[str, Any]], list[HealthSignal]]:
        sample = self.fleet.telemetry(self.node, time.time())
        gpus: list[dict[str, Any]] = sample["data"]["gpus"] if sample else []
        present = {g["index"] for g in gpus}
        lost = set(range(self.fleet.gpus)) - present
        signals = [
            HealthSignal("gpu_lost", {"gpu": g, "error": "GPU is lost"})
            for g in sorted(lost - self._lost)
        ]
        self._lost = lost
        return gpus, signals

    def wait_events(self, timeout_ms: int) -> list[HealthSignal]:
        with node_state.locked(self.fleet.node_dir(self.node)) as s:
            pending = s.pop("pending_events", [])
        if not pending:
            time.sleep(timeout_ms / 1000.0)
        return [HealthSignal(e["kind"], e["data"]) for e in pending]

    def pci_bus_ids(self) -> dict[tuple[int, int, int], int]:
        """Where the GPUs of an 8-GPU HGX board sit on the PCI bus (the sim has no bus)."""
        return {(0, bus, 0): i for i, bus in enumerate(SIM_PCI_BUSES[: self.fleet.gpus])}

    def close(self) -> None:
        return None
