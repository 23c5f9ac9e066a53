"""What the agent reads a node's GPUs through: real NVML, or a simulated node."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class HealthSignal:
    """Something the GPU said that must go out at once (XID, ECC event, GPU lost)."""

    kind: str  # xid | ecc | gpu_lost
    data: dict[str, Any]


class GpuBackend(Protocol):
    """One node's GPUs."""

    def gpu_count(self) -> int:
        """How many GPUs the node has."""
        ...

    def sample(self) -> tuple[list[dict[str, Any]], list[HealthSignal]]:
        """One reading of every GPU (GpuSample fields), and any GPU found lost meanwhile."""
        ...

    def wait_events(self, timeout_ms: int) -> list[HealthSignal]:
        """Block up to `timeout_ms` for XID and ECC events."""
        ...

    def close(self) -> None:
        """Release the library."""
        ...
