"""What the agent reads a node's GPUs through: real NVML, or a simulated node."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class HealthSignal:
    """Something the GPU said that must go out at once (XID, ECC event, GPU lost, SXid)."""

    kind: str  # xid | ecc | gpu_lost | sxid
    data: dict[str, Any]
    source: str = "agent"  # the event's `source`: agent (NVML), kmsg (the kernel log)


class GpuBackend(Protocol):
    """One node's GPUs."""

    def gpu_count(self) -> int:
        """How many GPUs the node has."""
        ...

    def sample(self) -> tuple[list[dict[str, Any]], list[HealthSignal]]:
        """One reading of every GPU (GpuSample fields), and any GPU found lost meanwhile."""
        ...

    def wait_events(self, timeout_ms: int) -> list[HealthSignal]:
        """Block up to `timeout_ms` for XID and ECC events; SourceError when the wait
        fails (the caller pauses before the next)."""
        ...

    def pci_bus_ids(self) -> dict[tuple[int, int, int], int]:
        """GPU index by PCI (domain, bus, device), to place kernel-log XIDs."""
        ...

    def close(self) -> None:
        """Release the library."""
        ...
