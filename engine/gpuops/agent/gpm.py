"""NVML GPM (Hopper and later): memory bandwidth, SM activity and NVLink bandwidth.

GPM metrics are differences between two samples of the GPU's performance counters.
Each telemetry interval takes one sample per GPU and compares it with the previous
interval's, so the loop never sleeps for a measurement: the first interval after start
(or after a GPU came back) has nothing to compare with and leaves the fields null.
Two sample buffers per GPU are allocated once and swapped.

A GPU without GPM (before Hopper), a driver without the functions, or a pynvml too old
to have them all leave the fields null; one metric the device refuses leaves only
that field null.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

MIB = 1024 * 1024
# GpuSample field, pynvml metric id name, factor to the field's unit.
METRICS: tuple[tuple[str, str, float], ...] = (
    ("dram_bw_util", "NVML_GPM_METRIC_DRAM_BW_UTIL", 1.0),
    ("sm_active", "NVML_GPM_METRIC_SM_UTIL", 1.0),
    ("sm_occupancy", "NVML_GPM_METRIC_SM_OCCUPANCY", 1.0),
    ("tensor_active", "NVML_GPM_METRIC_ANY_TENSOR_UTIL", 1.0),
    ("nvlink_rx_bytes_s", "NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC", MIB),  # MiB/s in NVML
    ("nvlink_tx_bytes_s", "NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC", MIB),
)
_FUNCTIONS = (
    "nvmlGpmQueryDeviceSupport",
    "nvmlGpmSampleAlloc",
    "nvmlGpmSampleGet",
    "nvmlGpmMetricsGet",
    "nvmlGpmSampleFree",
    "c_nvmlGpmMetricsGet_t",
)

Get = Callable[..., Any]


class Gpm:
    """GPM metrics per GPU from the sample of this interval and the one before."""

    def __init__(self, nv: Any, get: Get) -> None:
        self.nv = nv
        self.get = get  # the backend's call wrapper: None on refusal, raises when lost
        self.available = all(hasattr(nv, name) for name in _FUNCTIONS)
        self.supported: dict[int, bool] = {}
        self.prev: dict[int, Any] = {}
        self.spare: dict[int, Any] = {}

    def read(self, index: int, handle: Any) -> dict[str, float]:
        """This GPU's metrics since the previous call; empty on the first or when unsupported."""
        if not self._supported(index, handle):
            return {}
        sample = self.spare.pop(index, None) or self.get(self.nv.nvmlGpmSampleAlloc)
        if sample is None:
            return {}
        try:
            taken = self.get(self.nv.nvmlGpmSampleGet, handle, sample)
        except Exception:  # the GPU was lost: its counters start over when it returns
            self._free(sample)
            self.forget(index)
            raise
        if taken is None:
            self._free(sample)
            self.forget(index)
            return {}
        prev, self.prev[index] = self.prev.get(index), sample
        if prev is None:
            return {}
        self.spare[index] = prev
        return self._metrics(prev, sample)

    def forget(self, index: int) -> None:
        """Drop a GPU's previous sample (it was lost: counters start over when it returns)."""
        for held in (self.prev, self.spare):
            sample = held.pop(index, None)
            if sample is not None:
                self._free(sample)

    def close(self) -> None:
        """Free every sample buffer."""
        for index in list(self.prev) + list(self.spare):
            self.forget(index)

    def _supported(self, index: int, handle: Any) -> bool:
        if not self.available:
            return False
        known = self.supported.get(index)
        if known is None:
            answer = self.get(self.nv.nvmlGpmQueryDeviceSupport, handle)
            known = bool(answer is not None and answer.isSupportedDevice)
            self.supported[index] = known
            log.info("GPU %d: GPM %s", index, "supported" if known else "not supported")
        return known

    def _metrics(self, first: Any, second: Any) -> dict[str, float]:
        nv = self.nv
        wanted = [(f, getattr(nv, n), k) for f, n, k in METRICS if hasattr(nv, n)]
        request = nv.c_nvmlGpmMetricsGet_t()
        request.version = nv.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(wanted)
        request.sample1, request.sample2 = first, second
        for i, (_, metric_id, _) in enumerate(wanted):
            request.metrics[i].metricId = metric_id
        if self.get(nv.nvmlGpmMetricsGet, request) is None:
            return {}
        out = {}
        for i, (field, _, factor) in enumerate(wanted):
            metric = request.metrics[i]
            # A NaN or infinite reading would make the whole event a dead letter.
            if metric.nvmlReturn == 0 and math.isfinite(metric.value):
                out[field] = round(float(metric.value) * factor, 3)
        return out

    def _free(self, sample: Any) -> None:
        try:
            self.nv.nvmlGpmSampleFree(sample)
        except self.nv.NVMLError as exc:
            log.debug("nvmlGpmSampleFree: %s", exc)
