"""A pynvml stand-in whose answers come from the recorded H200 snapshot.

Only the device is fake: the error classes and constants are pynvml's own, so the
backend's error handling is exercised against the real library's types. Calls the
H200 answered "Not Supported" raise NotSupported here too (NVLink: the recorded board has
none; a test gives GPUs links through `nvlinks`).

GPM is the real protocol over fake counters: samples are real pynvml sample pointers,
the metrics request is pynvml's own ctypes structure, and a metric answers the figure a
test set in `gpm` (per GPU, by metric id) when the later of the two samples was taken.
Comparing a sample with itself or with a later one is refused, as NVML refuses it.
"""

from __future__ import annotations

import ctypes
import json
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pynvml

SNAPSHOT = json.loads(
    (Path(__file__).parent / "fixtures" / "nvml" / "h200_snapshot.json").read_text()
)


class FakeNvml:
    """Looks like the pynvml module for the calls the agent makes."""

    def __init__(self, gpus: int = 1) -> None:
        self.dev = SNAPSHOT["devices"][0]
        self.gpus = gpus
        self.lost: set[int] = set()
        self.events: deque[Any] = deque()
        self.event_waits = 0
        self.event_wait_error: int | None = None  # an NVML_ERROR_* every event wait answers
        self.calls = 0
        self.shutdown = False
        for name in dir(pynvml):
            if name.startswith(("NVML_", "nvmlEventType")) or name.startswith("NVMLError"):
                setattr(self, name, getattr(pynvml, name))
        self.c_nvmlGpmMetricsGet_t = pynvml.c_nvmlGpmMetricsGet_t
        # GPM: support as recorded; figures per GPU index, by NVML_GPM_METRIC_* id.
        self.gpm_supported = bool(self.dev["gpm_supported"]["isSupportedDevice"])
        self.gpm_in_driver = True  # False: a driver without the GPM functions
        self.gpm: dict[int, dict[int, float]] = {}
        self._samples: dict[int, tuple[Any, int, int, dict[int, float]]] = {}
        self._sample_seq = 0
        self.samples_freed = 0
        # NVLink: per GPU index, its links {"active", "crc", "replay", "recovery"}.
        self.nvlinks: dict[int, list[dict[str, Any]]] = {}
        self.nvlink_counters_supported = True  # False: per-link counters refused (newer drivers)
        self.extra_fields: dict[str, int] = {}  # NVML_FI_* values beyond the recorded ones
        # PCI location per GPU index (domain, bus, device); default: the recorded one, then next.
        pci = self.dev["pci"]
        self.pci = {i: (pci["domain"], pci["bus"], pci["device"] + i) for i in range(gpus)}

    def _dev(self, h: int) -> dict[str, Any]:
        self.calls += 1
        if h in self.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return self.dev

    @staticmethod
    def _value(v: Any) -> Any:
        if isinstance(v, dict) and "error" in v:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return v

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None:
        self.shutdown = True

    def nvmlDeviceGetCount(self) -> int:
        return self.gpus

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetIndex(self, h: int) -> int:
        return h

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"{self._dev(h)['uuid']}-{h}" if h else self._dev(h)["uuid"]

    def nvmlDeviceGetName(self, h: int) -> str:
        return str(self._dev(h)["name"])

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return int(self._dev(h)["temperature_gpu"])

    def nvmlDeviceGetTemperatureThreshold(self, h: int, which: int) -> int:
        th = self._dev(h)["temp_thresholds"]
        key = {
            pynvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN: "gpu_slowdown",
            pynvml.NVML_TEMPERATURE_THRESHOLD_SHUTDOWN: "gpu_shutdown",
            pynvml.NVML_TEMPERATURE_THRESHOLD_GPU_MAX: "gpu_max",
            pynvml.NVML_TEMPERATURE_THRESHOLD_MEM_MAX: "mem_max",
        }.get(which, "acoustic_curr")
        return int(self._value(th[key]))

    def nvmlDeviceGetFieldValues(self, h: int, ids: list[int]) -> list[Any]:
        fields = {**self._dev(h)["field_values_ok"], **self.extra_fields}
        out = []
        for fid in ids:
            name = next(
                (n for n in dir(pynvml) if n.startswith("NVML_FI_") and getattr(pynvml, n) == fid),
                "",
            )
            if name in fields:
                out.append(
                    SimpleNamespace(
                        nvmlReturn=0,
                        valueType=pynvml.NVML_VALUE_TYPE_UNSIGNED_INT,
                        value=SimpleNamespace(uiVal=fields[name]),
                    )
                )
            else:
                out.append(
                    SimpleNamespace(
                        nvmlReturn=pynvml.NVML_ERROR_NOT_SUPPORTED, valueType=0, value=None
                    )
                )
        return out

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return int(self._dev(h)["power_usage_mw"])

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        return int(self._dev(h)["power_enforced_limit_mw"])

    def nvmlDeviceGetPowerManagementDefaultLimit(self, h: int) -> int:
        return int(self._dev(h)["power_limit_default_mw"])

    def nvmlDeviceGetPowerManagementLimitConstraints(self, h: int) -> tuple[int, int]:
        lo, hi = self._dev(h)["power_limit_constraints_mw"]
        return lo, hi

    def nvmlDeviceGetTotalEnergyConsumption(self, h: int) -> int:
        return int(self._dev(h)["energy_mj"])

    def nvmlDeviceGetClockInfo(self, h: int, clock: int) -> int:
        return int(self._dev(h)["clock_sm" if clock == pynvml.NVML_CLOCK_SM else "clock_mem"])

    def nvmlDeviceGetMaxClockInfo(self, h: int, clock: int) -> int:
        return int(
            self._dev(h)["max_clock_sm" if clock == pynvml.NVML_CLOCK_SM else "max_clock_mem"]
        )

    def nvmlDeviceGetApplicationsClock(self, h: int, clock: int) -> int:
        return int(self._dev(h)["app_clock_sm"])

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return int(self._dev(h)["clocks_event_reasons"])

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        u = self._dev(h)["utilization"]
        return SimpleNamespace(gpu=u["gpu"], memory=u["memory"])

    def nvmlDeviceGetPerformanceState(self, h: int) -> int:
        return int(self._dev(h)["pstate"])

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return SimpleNamespace(**self._dev(h)["memory"])

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        d = self._dev(h)
        if kind == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED:
            return int(d["ecc_corrected_volatile"]) if counter == pynvml.NVML_VOLATILE_ECC else 0
        return int(
            d[
                "ecc_uncorrected_volatile"
                if counter == pynvml.NVML_VOLATILE_ECC
                else "ecc_uncorrected_aggregate"
            ]
        )

    def nvmlDeviceGetRemappedRows(self, h: int) -> tuple[int, int, int, int]:
        a, b, c, d = self._dev(h)["remapped_rows"]
        return a, b, c, d

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h: int) -> int:
        return int(self._value(self._dev(h)["retired_pending"]))

    def nvmlDeviceGetFanSpeed(self, h: int) -> int:
        return int(self._value(self._dev(h)["fan"]))

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: int) -> int:
        return int(self._dev(h)["pcie_gen"])

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: int) -> int:
        return int(self._dev(h)["pcie_width"])

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:
        return int(self._dev(h)["pcie_max_gen"])

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: int) -> int:
        return int(self._dev(h)["pcie_max_width"])

    def nvmlDeviceGetPcieReplayCounter(self, h: int) -> int:
        return int(self._dev(h)["pcie_replay"])

    def nvmlDeviceGetPersistenceMode(self, h: int) -> int:
        return int(self._dev(h)["persistence_mode"])

    def nvmlDeviceGetEccMode(self, h: int) -> tuple[int, int]:
        a, b = self._dev(h)["ecc_mode"]
        return a, b

    def nvmlDeviceGetMigMode(self, h: int) -> tuple[int, int]:
        a, b = self._dev(h)["mig_mode"]
        return a, b

    def nvmlDeviceGetComputeMode(self, h: int) -> int:
        return int(self._dev(h)["compute_mode"])

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlDeviceRegisterEvents(self, h: int, mask: int, event_set: str) -> None:
        self.registered = mask

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> Any:
        self.event_waits += 1
        if self.event_wait_error is not None:  # at once, as NVML answers for a lost GPU
            raise pynvml.NVMLError(self.event_wait_error)
        if not self.events:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return self.events.popleft()

    # --- PCI, NVLink ------------------------------------------------------------------

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        self._dev(h)
        domain, bus, device = self.pci[h]
        bus_id = f"{domain:08x}:{bus:02x}:{device:02x}.0".encode()
        return SimpleNamespace(domain=domain, bus=bus, device=device, busId=bus_id)

    def _link(self, h: int, link: int) -> dict[str, Any]:
        self._dev(h)
        links = self.nvlinks.get(h, [])
        if link >= len(links):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return links[link]

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        return pynvml.NVML_FEATURE_ENABLED if self._link(h, link)["active"] else 0

    def nvmlDeviceGetNvLinkErrorCounter(self, h: int, link: int, counter: int) -> int:
        info = self._link(h, link)
        if not self.nvlink_counters_supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        key = {
            pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc",
            pynvml.NVML_NVLINK_ERROR_DL_REPLAY: "replay",
            pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery",
        }[counter]
        return int(info.get(key, 0))

    # --- GPM ----------------------------------------------------------------------------

    def _gpm_call(self) -> None:
        if not self.gpm_in_driver:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    def nvmlGpmQueryDeviceSupport(self, h: int) -> Any:
        self._gpm_call()
        self._dev(h)
        return SimpleNamespace(version=1, isSupportedDevice=int(self.gpm_supported))

    def nvmlGpmSampleAlloc(self) -> Any:
        self._gpm_call()
        return ctypes.pointer(pynvml.struct_c_nvmlGpmSample_t())

    def nvmlGpmSampleFree(self, sample: Any) -> None:
        self._samples.pop(ctypes.addressof(sample.contents), None)
        self.samples_freed += 1

    def nvmlGpmSampleGet(self, h: int, sample: Any) -> Any:
        self._dev(h)
        if not self.gpm_supported:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        self._sample_seq += 1
        figures = dict(self.gpm.get(h, {}))
        self._samples[ctypes.addressof(sample.contents)] = (sample, h, self._sample_seq, figures)
        return sample

    def nvmlGpmMetricsGet(self, request: Any) -> Any:
        first = self._samples.get(ctypes.addressof(request.sample1.contents))
        second = self._samples.get(ctypes.addressof(request.sample2.contents))
        if first is None or second is None or first[1] != second[1] or first[2] >= second[2]:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        figures = second[3]
        for i in range(request.numMetrics):
            metric = request.metrics[i]
            if metric.metricId in figures:
                metric.nvmlReturn, metric.value = 0, figures[metric.metricId]
            else:
                metric.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return request
