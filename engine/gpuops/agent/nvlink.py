"""NVLink per link: which links the GPU has, which are active, and their error counters.

A link whose state NVML refuses (NotSupported, InvalidArgument past the device's last
link) does not exist. Which links exist is found once per GPU (up to
NVML_NVLINK_MAX_LINKS calls) and kept: a board without NVLink then costs nothing per
interval, and a link that goes down still answers its state (inactive), so it stays
counted. Error counters are summed over the links; where the per-link call is refused
(newer drivers moved them), the device-wide field values are read instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Get = Callable[..., Any]
Field = Callable[[Any, int], Any]

# GpuSample field, per-link counter name, device-wide field value name (pynvml).
COUNTERS: tuple[tuple[str, str, str], ...] = (
    (
        "nvlink_crc_errors",
        "NVML_NVLINK_ERROR_DL_CRC_FLIT",
        "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_TOTAL",
    ),
    (
        "nvlink_replay_errors",
        "NVML_NVLINK_ERROR_DL_REPLAY",
        "NVML_FI_DEV_NVLINK_REPLAY_ERROR_COUNT_TOTAL",
    ),
    (
        "nvlink_recovery_errors",
        "NVML_NVLINK_ERROR_DL_RECOVERY",
        "NVML_FI_DEV_NVLINK_RECOVERY_ERROR_COUNT_TOTAL",
    ),
)


class NvLinks:
    """Reads the NVLink fields of a GPU."""

    def __init__(self, nv: Any, get: Get, field: Field) -> None:
        self.nv = nv
        self.get = get  # the backend's call wrapper: None on refusal, raises when lost
        self.field = field
        self.links: dict[int, tuple[int, ...]] = {}

    def read(self, index: int, handle: Any) -> dict[str, Any]:
        """Link counts and summed error counters; nothing for a GPU without NVLink."""
        links = self.links.get(index)
        if links is None:
            links = self.links[index] = self._discover(handle)
        if not links:
            return {}
        states = [self.get(self.nv.nvmlDeviceGetNvLinkState, handle, link) for link in links]
        active = sum(1 for s in states if s == self.nv.NVML_FEATURE_ENABLED)
        out: dict[str, Any] = {
            "nvlink_links_active": active,
            "nvlink_links_down": len(links) - active,
        }
        for name, counter, field_name in COUNTERS:
            out[name] = self._counter(handle, links, counter, field_name)
        return out

    def _discover(self, handle: Any) -> tuple[int, ...]:
        count = int(getattr(self.nv, "NVML_NVLINK_MAX_LINKS", 0))
        nv_state = self.nv.nvmlDeviceGetNvLinkState
        return tuple(link for link in range(count) if self.get(nv_state, handle, link) is not None)

    def _counter(
        self, handle: Any, links: tuple[int, ...], counter: str, field_name: str
    ) -> int | None:
        nv = self.nv
        if hasattr(nv, counter):
            read = nv.nvmlDeviceGetNvLinkErrorCounter
            values = [self.get(read, handle, link, getattr(nv, counter)) for link in links]
            present = [int(v) for v in values if v is not None]
            if present:
                return sum(present)
        if hasattr(nv, field_name):
            total = self.field(handle, getattr(nv, field_name))
            return None if total is None else int(total)
        return None
